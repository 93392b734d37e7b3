"""Distributed speculative inference (DSI, speculation parallelism): servers.py (target server
processes), orchestrator.py (Algorithm 1 over them), mode.py (the Engine's mode "dsi"), sim.py
(the paper's offline simulation and Equation 1)."""
