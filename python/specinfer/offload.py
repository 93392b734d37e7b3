"""Offloading: the target's decoder layers are not kept; every forward streams them in, layer by
layer, into a ring of reused buffers (the SpecInfer paper's offloading setting, FlexGen's double
buffering, read further ahead). A token tree verified in one such pass yields several tokens per
weight pass.

- "disk": the layers live in a file written once from the checkpoint in the engine's dtype (in a
  cache folder, trusted only with its manifest, which is written last). A reader thread reads
  layer i+1 with O_DIRECT (no page cache: the read is the disk's, every time) while layer i
  computes. Where the file system refuses O_DIRECT, buffered reads with the pages dropped after
  each read, and a warning.
- "cpu" (a CUDA device): the layers live in pinned host memory and are copied to the GPU on a
  copy stream, layer i+1 while layer i computes.

Embeddings, the final norm, the LM head, the KV cache and the SSMs stay resident, and so do the
first `resident` layers (a model that half fits; a layer-selected SSM's layers). Each streamed
layer's parameters are views of one of a ring of buffers, always the same one for a layer (the
k-th streamed layer's is buffer k % slots); a forward pre-hook waits for its bytes and starts
reading the next layers into every buffer no longer in use, so the reader runs ahead by several
layers: across a layer that computes faster than it reads, and across the end of a forward into
the next one's first layers while the step drafts and verifies (with two buffers, the time
between forwards would be lost to the reader). The ring holds READ_AHEAD bytes at most (two
buffers at least). An op graph (graphs.py) recorded over the layers stays valid: it is recorded
in segments split at these hooks (`split`), and a replay calls `bring_in` before each segment.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import mmap
import os
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("specinfer")

MODES = ("cpu", "disk")
ALIGN = 4096  # O_DIRECT: file offsets, sizes and buffer addresses in multiples of the block size
PARAM_ALIGN = 64  # each parameter's start within a layer, for vector loads
FORMAT = 1  # of the layer file; a manifest of another format is not trusted
# Bytes of the ring of layer buffers (at least two layers). The reader reads the next forward's
# first layers while a step drafts and verifies; 64 MB (SmolLM2's next 5 layers) ran out before
# the step did: 128 MB (14 layers) made speculating from disk 10% faster a token.
READ_AHEAD = 128 << 20
HUGE_PAGE = 2 << 20


class OffloadError(RuntimeError):
    pass


def default_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "specinfer" / "offload"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Layout:
    """Where each parameter of a layer sits in its bytes; every streamed layer has the same."""

    def __init__(self, layer: nn.Module):
        self.entries = []  # (name, shape, dtype, offset)
        offset = 0
        for name, p in layer.named_parameters():
            offset = _round_up(offset, PARAM_ALIGN)
            self.entries.append((name, tuple(p.shape), p.dtype, offset))
            offset += p.numel() * p.element_size()
        self.stride = _round_up(offset, ALIGN)  # bytes a layer takes in the file and a buffer

    def describe(self) -> list:
        return [[n, list(s), str(d).removeprefix("torch."), o] for n, s, d, o in self.entries]

    def check(self, layer: nn.Module, index: int) -> None:
        shapes = [(n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()]
        if shapes != [(n, s, d) for n, s, d, _ in self.entries]:
            raise OffloadError(f"layer {index} differs in its parameters from the first streamed "
                               "layer; offloading needs layers of one shape")  # fmt: skip

    def pack(self, layer: nn.Module, out: torch.Tensor) -> None:
        """The layer's parameters as bytes into out [stride] uint8 (padding zeroed)."""
        out.zero_()
        params = dict(layer.named_parameters())
        for name, _, _, offset in self.entries:
            raw = params[name].detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            out[offset : offset + raw.numel()].copy_(raw)

    def views(self, buffer: torch.Tensor) -> list[nn.Parameter]:
        """Parameters over a layer's bytes in `buffer`: they change when the buffer does."""
        out = []
        for _, shape, dtype, offset in self.entries:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            view = buffer[offset : offset + nbytes].view(dtype).view(shape)
            out.append(nn.Parameter(view, requires_grad=False))
        return out


def aligned_buffer(nbytes: int, device: torch.device, pin: bool = False) -> torch.Tensor:
    """nbytes uint8 starting at an ALIGN-aligned address (the view keeps its storage alive).
    Unpinned host buffers are backed by transparent huge pages where the OS offers them: an
    O_DIRECT read into 2 MB pages pins a few pages, not thousands, and measured 15-50% faster
    than into 4 KB pages here (the ring's reads are what an offloaded step waits for)."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)  # allocator-aligned
    if pin or not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE:
        raw, align = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin), ALIGN
    else:
        # Anonymous and private (a shared mapping is shmem, which huge pages skip); untouched
        # until the madvise, so its pages fault in huge. The tensor keeps the mapping alive.
        area = mmap.mmap(-1, _round_up(nbytes, HUGE_PAGE) + HUGE_PAGE,
                         flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # fmt: skip
        area.madvise(mmap.MADV_HUGEPAGE)
        raw, align = torch.frombuffer(area, dtype=torch.uint8), HUGE_PAGE
    shift = (-raw.data_ptr()) % align
    return raw[shift : shift + nbytes]


# --- the layer file ----------------------------------------------------------------------------


def layer_file(folder: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return folder / f"{digest}.layers"


def _manifest(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def trusted(path: Path, key: dict, size: int) -> bool:
    """Whether a complete layer file for `key` is there: its manifest (written last) says so."""
    try:
        manifest = json.loads(_manifest(path).read_text())
        return (manifest.get("format") == FORMAT and manifest.get("key") == key
                and manifest.get("size") == size and path.stat().st_size == size)  # fmt: skip
    except (OSError, ValueError):
        return False


def _write_blob(f, blob: torch.Tensor) -> None:
    f.write(memoryview(blob.numpy()))


def write_layer_file(path: Path, key: dict, layout: Layout, layers: list[nn.Module]) -> None:
    """Write the layers' bytes to `path` (via a .partial file renamed when complete), then the
    manifest. On any failure nothing is left that `trusted` would accept."""
    from tqdm import tqdm

    folder, size = path.parent, layout.stride * len(layers)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise OffloadError(f"the offload folder {folder} is not writable: {e.strerror or e} "
                           "(pass offload_dir= / --offload-dir elsewhere)") from e  # fmt: skip
    free = shutil.disk_usage(folder).free
    if free < size:
        raise OffloadError(f"not enough disk space in {folder} for the offloaded layers: "
                           f"{size / 1e6:.0f} MB needed, {free / 1e6:.0f} MB free")  # fmt: skip
    _manifest(path).unlink(missing_ok=True)
    partial = path.with_name(path.name + ".partial")
    blob = aligned_buffer(layout.stride, torch.device("cpu"))
    try:
        with open(partial, "wb") as f:
            for layer in tqdm(layers, desc=f"writing offloaded layers to {path.name}",
                              unit="layer", leave=False):  # fmt: skip
                layout.pack(layer, blob)
                _write_blob(f, blob)
            f.flush()
            os.fsync(f.fileno())
        partial.replace(path)
        manifest = {"format": FORMAT, "key": key, "size": size, "stride": layout.stride,
                    "layout": layout.describe()}  # fmt: skip
        tmp = _manifest(path).with_suffix(".json.partial")
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.replace(_manifest(path))
    except OSError as e:
        for p in (partial, path, _manifest(path).with_suffix(".json.partial")):
            p.unlink(missing_ok=True)
        why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise OffloadError(f"writing the offloaded layers to {path} failed: {why}; "
                           "nothing was kept") from e  # fmt: skip


class DiskReader:
    """Reads layer k's bytes of the layer file into an aligned buffer, around the page cache."""

    def __init__(self, path: Path, stride: int):
        self.path, self.stride = path, stride
        self.direct = hasattr(os, "O_DIRECT")
        self.fd = self._open()

    def _open(self) -> int:
        if self.direct:
            try:
                return os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                self._refused(e)
        return os.open(self.path, os.O_RDONLY)

    def _refused(self, e: OSError) -> None:
        log.warning("O_DIRECT refused for %s (%s): reading through the page cache, dropping "
                    "each layer's pages after its read", self.path, e.strerror or e)  # fmt: skip
        self.direct = False

    def read(self, k: int, out: torch.Tensor) -> torch.Tensor:
        view, offset, done = memoryview(out.numpy()), k * self.stride, 0
        while done < self.stride:
            try:
                n = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise OffloadError(f"reading layer {k} of {self.path}: {e}") from e
                self._refused(e)  # open accepted O_DIRECT but reads refuse it
                os.close(self.fd)
                self.fd = self._open()
                continue
            if n == 0:
                raise OffloadError(f"{self.path} ends inside layer {k}: the file was changed")
            done += n
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, self.stride, os.POSIX_FADV_DONTNEED)
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# --- streaming ---------------------------------------------------------------------------------


class LayerStreamer:
    """Streams `layers` ({layer index: module}, in forward order) into a ring of buffers; see
    the module docstring. `fetch(k, host_buffer)` returns the host tensor holding streamed layer
    k's bytes: read into host_buffer (disk) or a slice of pinned memory (cpu)."""

    def __init__(self, layers: dict[int, nn.Module], layout: Layout, fetch, device: torch.device,
                 host_buffers: bool, closers=(), path: Path | None = None):  # fmt: skip
        self.order = list(layers)
        self.pos = {i: k for k, i in enumerate(self.order)}
        self.layout, self.fetch, self.device = layout, fetch, device
        self.path = path  # the layer file ("disk"), else None
        self.cuda = device.type == "cuda"
        self.slots = _ring_size(len(self.order), max(2, READ_AHEAD // layout.stride))
        cpu = torch.device("cpu")
        self.host = [aligned_buffer(layout.stride, cpu, pin=self.cuda) if host_buffers else None
                     for _ in range(self.slots)]  # fmt: skip
        self.buffers = ([aligned_buffer(layout.stride, device) for _ in range(self.slots)]
                        if self.cuda else self.host)  # fmt: skip
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.free = [torch.cuda.Event() for _ in range(self.slots)]
            self.ready = [torch.cuda.Event() for _ in range(self.slots)]
        self.params = [layout.views(buffer) for buffer in self.buffers]
        self.owners = {i: [_owner(layer, name) for name, *_ in layout.entries]
                       for i, layer in layers.items()}  # fmt: skip
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="specinfer-offload")
        self.ahead = deque()  # (streamed layer k, future of its read into buffer k % slots)
        # Called with a layer's index once its bytes are in, before it runs: a graph that
        # records splits there (graphs.py), so its replay brings the layer in at that point.
        self.split = None
        self.bytes = 0  # of the layers the forwards have run so far
        self.read_s = 0.0  # the reader's time reading (and copying)
        self.wait_s = 0.0  # the forward's time waiting for a layer's bytes
        self._closers = list(closers)
        for i, layer in layers.items():
            self._bind(i, 0)  # the originals' memory goes; shapes and dtypes stay readable
            layer.register_forward_pre_hook(lambda module, args, i=i: self.bring_in(i))

    @property
    def layer_bytes(self) -> int:
        return self.layout.stride * len(self.order)

    def _bind(self, i: int, slot: int) -> None:
        for (module, leaf), param in zip(self.owners[i], self.params[slot]):
            module._parameters[leaf] = param

    def _load(self, k: int, slot: int) -> None:
        start = time.perf_counter()
        src = self.fetch(k, self.host[slot])
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.free[slot])
                self.buffers[slot].copy_(src, non_blocking=True)
                self.ready[slot].record(self.copy_stream)
            self.ready[slot].synchronize()  # the host buffer may be refilled after this
        self.read_s += time.perf_counter() - start

    def _start(self, k: int) -> None:
        slot = k % self.slots
        if self.cuda:  # the copy into `slot` waits for the work queued on it so far
            self.free[slot].record(torch.cuda.current_stream(self.device))
        self.ahead.append((k, self.pool.submit(self._load, k, slot)))

    def bring_in(self, i: int) -> None:
        """Before layer i runs (the layer before it has run, so its buffer is free): its bytes
        are in its buffer, bound to its parameters, and the next layers' reads are started into
        every free buffer, in forward order, wrapping round to the next forward's first."""
        k = self.pos[i]
        if not self.ahead or self.ahead[0][0] != k:  # first use, or a forward broke off
            self._drain()
            self._start(k)
        _, future = self.ahead.popleft()
        start = time.perf_counter()
        future.result()
        self.wait_s += time.perf_counter() - start
        slot = k % self.slots
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
        self._bind(i, slot)
        self.bytes += self.layout.stride
        busy = {slot} | {j % self.slots for j, _ in self.ahead}
        following = (self.ahead[-1][0] if self.ahead else k) + 1
        while len(busy) < self.slots:
            following %= len(self.order)
            if following % self.slots in busy:  # the ring wraps unevenly round a forward
                break
            busy.add(following % self.slots)
            self._start(following)
            following += 1
        if self.split is not None:
            self.split(i)

    def _drain(self) -> None:
        """Drop the reads ahead: cancelled if not begun, else waited for (they write into
        buffers about to be reused); a failed one is retried by the layer that needs it."""
        while self.ahead:
            _, future = self.ahead.popleft()
            if not future.cancel():
                future.exception()

    def close(self) -> None:
        self._drain()
        self.pool.shutdown(wait=True)
        for close in self._closers:
            close()
        self._closers = []


def _ring_size(layers: int, most: int) -> int:
    """Buffers for `layers` streamed layers, `most` at most: a layer keeps its buffer (k % size),
    so at the end of a forward the next one's first (layers - 1) % size layers can be read ahead
    (then the last layer's buffer is needed): the size that reads most there, then the larger."""
    if layers == 1:
        return 1
    return max(range(2, min(layers, most) + 1), key=lambda size: ((layers - 1) % size, size))


def _owner(layer: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return (layer.get_submodule(prefix) if prefix else layer), leaf


# --- setting a model up --------------------------------------------------------------------------


def check_mode(mode, device: torch.device) -> None:
    if mode not in MODES:
        raise ValueError(f"offload must be None, 'cpu' or 'disk', got {mode!r}")
    if mode == "cpu" and device.type != "cuda":
        raise ValueError(f"offload='cpu' streams layers from host memory to a GPU, but the "
                         f"device is {device.type}: use offload='disk' on the CPU")  # fmt: skip


def offload_model(model: nn.Module, mode: str, device: torch.device, checkpoint: Path,
                  folder: Path | None = None, resident: int = 0) -> LayerStreamer:  # fmt: skip
    """Stream `model`'s decoder layers from `resident` on (see the module docstring); the
    model's `layer_streamer` is set, which its op graphs split at (graphs.py)."""
    check_mode(mode, device)
    all_layers = list(model.decoder_layers())
    if (
        not isinstance(resident, int)
        or isinstance(resident, bool)
        or not (0 <= resident < len(all_layers))
    ):
        raise ValueError(f"resident_layers must be an integer in [0, {len(all_layers)}) "
                         f"(the model has {len(all_layers)} layers), got {resident!r}")  # fmt: skip
    layers = dict(enumerate(all_layers))
    streamed = {i: m for i, m in layers.items() if i >= resident}
    layout = Layout(streamed[resident])
    for i, layer in streamed.items():
        layout.check(layer, i)
    if mode == "cpu":
        pinned = aligned_buffer(layout.stride * len(streamed), torch.device("cpu"), pin=True)
        for k, layer in enumerate(streamed.values()):
            layout.pack(layer, pinned[k * layout.stride : (k + 1) * layout.stride])
        fetch = lambda k, _: pinned[k * layout.stride : (k + 1) * layout.stride]  # noqa: E731
        streamer = LayerStreamer(streamed, layout, fetch, device, host_buffers=False)
    else:
        stat = checkpoint.stat()
        key = {"checkpoint": str(checkpoint.resolve()), "size": stat.st_size,
               "mtime_ns": stat.st_mtime_ns, "layers": [resident, len(all_layers)],
               "layout": layout.describe()}  # fmt: skip
        path = layer_file(Path(folder) if folder else default_dir(), key)
        if not trusted(path, key, layout.stride * len(streamed)):
            write_layer_file(path, key, layout, list(streamed.values()))
        reader = DiskReader(path, layout.stride)
        streamer = LayerStreamer(streamed, layout, reader.read, device, host_buffers=True,
                                 closers=[reader.close], path=path)  # fmt: skip
    model.layer_streamer = streamer
    return streamer
