"""Distributed speculative inference (DSI, speculation parallelism): sim.py is the paper's
offline simulation and Equation 1."""
