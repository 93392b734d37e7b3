"""Offloading (specinfer.offload): the target's layers streamed from a file (or, on a GPU, from
pinned host memory) give bit-identical outputs to resident weights, greedy and seeded sampling,
incremental and speculative; the bytes streamed are counted per request; the layer file is
written once and trusted only when complete; bad input is refused with a clear error."""

import errno
import logging
import mmap
import os

import pytest
import torch

import specinfer.offload as offload
from specinfer import Engine, SamplingParams
from test_speculative import PROMPT, _tiny_llama, tiny_pair  # noqa: F401

PROMPTS = [PROMPT, [3, 3, 1, 0, 5], [2]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=s) for s in range(3)]
SPEC = dict(ssm=None, tree="2,2,1", adaptive_tree=False)  # ssm filled in with the tiny SSM


def _ids(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def _run(target, params, **kwargs) -> list[list[int]]:
    with Engine(target, **kwargs) as engine:
        return _ids(engine.generate(PROMPTS, params))


def _no_files_left(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("speculative", [False, True], ids=["incremental", "speculative"])
def test_disk_offload_is_bit_identical_to_resident(tiny_pair, tmp_path, dtype, speculative):  # noqa: F811
    target, other = tiny_pair
    kwargs = {"dtype": dtype}
    if speculative:
        kwargs.update(SPEC, ssm=[other, "ngram"])
    for params in (GREEDY, SEEDED):
        resident = _run(target, params, **kwargs)
        streamed = _run(target, params, offload="disk", offload_dir=tmp_path, **kwargs)
        assert streamed == resident


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists("/proc/self/smaps"),
                    reason="transparent huge pages are a Linux feature")  # fmt: skip
def test_large_host_buffers_are_huge_page_aligned_and_advised():
    big = offload.aligned_buffer(3 << 20, torch.device("cpu"))
    assert big.numel() == 3 << 20 and big.data_ptr() % offload.HUGE_PAGE == 0
    big.fill_(7)
    assert int(big.sum()) == 7 * (3 << 20)
    assert "hg" in _mapping_flags(big.data_ptr())  # madvise(MADV_HUGEPAGE) took
    small = offload.aligned_buffer(5000, torch.device("cpu"))
    assert small.numel() == 5000 and small.data_ptr() % offload.ALIGN == 0


def test_huge_page_ring_buffers_stream_bit_identically(tiny_pair, tmp_path, monkeypatch):  # noqa: F811
    """The tiny model's layers are smaller than a huge page: shrink the threshold so its ring
    takes the mmap path that real models' rings take."""
    target, other = tiny_pair
    kwargs = dict(SPEC, ssm=[other, "ngram"], dtype="bfloat16")
    resident = _run(target, GREEDY, **kwargs)
    monkeypatch.setattr(offload, "HUGE_PAGE", offload.ALIGN)
    assert _run(target, GREEDY, offload="disk", offload_dir=tmp_path, **kwargs) == resident


def test_bytes_streamed_are_counted_per_request_and_per_forward(tiny_pair, tmp_path):  # noqa: F811
    target, other = tiny_pair
    with Engine(target, dtype="float32", offload="disk", offload_dir=tmp_path,
                ssm=[other, "ngram"], tree="2,2,1", adaptive_tree=False) as engine:  # fmt: skip
        streamer = engine.runner.streamer
        before, forwards = streamer.bytes, engine.runner.forwards
        outs = engine.generate(PROMPTS, GREEDY)
        streamed = streamer.bytes - before
        forwards = engine.runner.forwards - forwards
    # Every target forward streams every layer once, whatever its batch; the requests in a
    # forward share its bytes.
    assert streamer.layer_bytes > 0 and forwards > len(PROMPTS)
    assert streamed == forwards * streamer.layer_bytes
    charged = sum(o.metrics["weight_bytes"] for o in outs)
    assert charged == pytest.approx(streamed, rel=1e-9)
    assert all(o.metrics["stream_s"] >= 0 for o in outs)
    assert streamer.read_s > 0


@pytest.mark.parametrize("resident", [0, 1], ids=["3 streamed", "2 streamed"])
def test_op_graphs_replay_over_streamed_layers(tiny_pair, tmp_path, resident):  # noqa: F811
    # bfloat16 runs compiled ops only, so forwards are recorded (in segments split where a
    # streamed layer is brought in) and replayed, while the reader fills the buffers ahead.
    target, other = tiny_pair
    kwargs = dict(SPEC, ssm=[other, "ngram"], dtype="bfloat16")
    resident_ids = _run(target, GREEDY, **kwargs)
    with Engine(target, offload="disk", offload_dir=tmp_path, resident_layers=resident,
                **kwargs) as engine:  # fmt: skip
        streamer, graphs = engine.runner.streamer, engine.runner.graphs
        before, forwards = streamer.bytes, engine.runner.forwards
        assert _ids(engine.generate(PROMPTS, GREEDY)) == resident_ids
        assert graphs.replays > 0 and not graphs._refused
        assert streamer.bytes - before == (engine.runner.forwards - forwards) * streamer.layer_bytes


@pytest.mark.parametrize("layers, most, ahead", [(5, 3, 1), (6, 3, 2), (4, 2, 1), (1, 4, 0)])
def test_the_reader_runs_ahead_into_free_buffers_only(layers, most, ahead, monkeypatch):
    # Layers streamed from packed bytes through a ring of `most` buffers, three forwards. After
    # each layer has run and the reads started so far are done, its buffer still holds its bytes
    # (no read went into the buffer of the layer running) and so does every buffer read ahead;
    # after a forward the next one's first `ahead` layers are read already; every forward reads
    # every layer once, in order; outputs are the resident layers'.
    torch.manual_seed(0)
    resident = [torch.nn.Linear(8, 8) for _ in range(layers)]
    streamed = [torch.nn.Linear(8, 8) for _ in range(layers)]
    layout = offload.Layout(resident[0])
    packed = torch.empty(layers, layout.stride, dtype=torch.uint8)
    for k, layer in enumerate(resident):
        layout.pack(layer, packed[k])
    reads = []

    def fetch(k, host):
        reads.append(k)
        return host.copy_(packed[k])

    monkeypatch.setattr(offload, "READ_AHEAD", most * layout.stride)
    streamer = offload.LayerStreamer(dict(enumerate(streamed)), layout, fetch,
                                     torch.device("cpu"), host_buffers=True)  # fmt: skip
    holds = lambda k: torch.equal(streamer.host[k % streamer.slots], packed[k])  # noqa: E731
    x = torch.randn(2, 8)
    for _ in range(3):
        want, got = x, x
        for k in range(layers):
            want, got = resident[k](want), streamed[k](got)
            streamer.pool.submit(lambda: None).result()  # the reads started so far are done
            assert holds(k) and all(holds(j) for j, _ in streamer.ahead)
        assert torch.equal(got, want)
        assert [k for k, _ in streamer.ahead] == list(range(ahead))
    streamer.close()
    assert streamer.slots == min(most, layers)
    assert reads == (list(range(layers)) * 4)[: 3 * layers + ahead]
    assert streamer.bytes == 3 * layers * layout.stride


def test_resident_layers_stay_and_the_rest_stream(tiny_pair, tmp_path):  # noqa: F811
    target, _ = tiny_pair
    resident = _run(target, GREEDY, dtype="float32")
    with Engine(target, dtype="float32", offload="disk", offload_dir=tmp_path,
                resident_layers=2) as engine:  # fmt: skip
        assert engine.runner.streamer.order == [2]  # the tiny target has 3 layers
        assert _ids(engine.generate(PROMPTS, GREEDY)) == resident


def test_the_layer_file_is_written_once_and_reused(tiny_pair, tmp_path, monkeypatch):  # noqa: F811
    target, _ = tiny_pair
    first = _run(target, GREEDY, dtype="float32", offload="disk", offload_dir=tmp_path)
    files = _no_files_left(tmp_path)
    assert len(files) == 2 and any(f.endswith(".layers.json") for f in files)

    def no_writing(*args):
        raise AssertionError("a trusted layer file was written again")

    monkeypatch.setattr(offload, "write_layer_file", no_writing)
    assert _run(target, GREEDY, dtype="float32", offload="disk", offload_dir=tmp_path) == first


def test_a_truncated_layer_file_is_not_trusted_but_rewritten(tiny_pair, tmp_path):  # noqa: F811
    target, _ = tiny_pair
    first = _run(target, GREEDY, dtype="float32", offload="disk", offload_dir=tmp_path)
    (layers,) = tmp_path.glob("*.layers")
    with open(layers, "r+b") as f:
        f.truncate(layers.stat().st_size // 2)
    assert _run(target, GREEDY, dtype="float32", offload="disk", offload_dir=tmp_path) == first
    (layers,) = tmp_path.glob("*.layers")
    assert layers.stat().st_size % offload.ALIGN == 0 and layers.stat().st_size > 0


def test_a_full_disk_while_writing_leaves_nothing(tiny_pair, tmp_path, monkeypatch):  # noqa: F811
    target, _ = tiny_pair
    written = []

    def fill_up(f, blob):
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(1)
        f.write(memoryview(blob.numpy()))

    monkeypatch.setattr(offload, "_write_blob", fill_up)
    with pytest.raises(offload.OffloadError, match="the disk is full; nothing was kept"):
        Engine(target, dtype="float32", offload="disk", offload_dir=tmp_path)
    assert _no_files_left(tmp_path) == []


def test_too_little_free_space_is_refused_before_writing(tiny_pair, tmp_path, monkeypatch):  # noqa: F811
    target, _ = tiny_pair
    real = offload.shutil.disk_usage
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(
        offload.OffloadError, match=r"not enough disk space .* MB needed, 0 MB free"
    ):
        Engine(target, dtype="float32", offload="disk", offload_dir=tmp_path)
    assert _no_files_left(tmp_path) == []


def test_an_unwritable_offload_folder_is_a_clear_error(tiny_pair, tmp_path):  # noqa: F811
    target, _ = tiny_pair
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for folder in (blocker / "offload", "/proc/specinfer-offload"):
        with pytest.raises(offload.OffloadError, match="offload folder .* is not writable"):
            Engine(target, dtype="float32", offload="disk", offload_dir=folder)


def test_without_o_direct_reads_fall_back_with_a_warning(tiny_pair, tmp_path, monkeypatch, caplog):  # noqa: F811
    target, _ = tiny_pair
    resident = _run(target, GREEDY, dtype="float32")
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(offload.os, "open", refuse_direct)
    with caplog.at_level(logging.WARNING, logger="specinfer"):
        streamed = _run(target, GREEDY, dtype="float32", offload="disk", offload_dir=tmp_path)
    assert streamed == resident
    assert "O_DIRECT refused" in caplog.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"offload": "ram"}, "offload must be None, 'cpu' or 'disk', got 'ram'"),
        ({"offload": "cpu"}, "offload='cpu' streams layers from host memory to a GPU"),
        (
            {"offload": "disk", "resident_layers": 3},
            r"resident_layers must be an integer in \[0, 3\)",
        ),
        ({"offload": "disk", "resident_layers": -1}, "resident_layers must be an integer >= 0"),
        (
            {"offload": "disk", "tensor_parallel": 2},
            "offload is not supported with tensor_parallel",
        ),
        ({"resident_layers": 1}, "resident_layers applies with offload="),
    ],
)
def test_bad_offload_settings_are_refused(tiny_pair, tmp_path, kwargs, message):  # noqa: F811
    target, _ = tiny_pair
    with pytest.raises(ValueError, match=message):
        Engine(target, dtype="float32", offload_dir=tmp_path, **kwargs)


def test_a_layer_selected_ssm_keeps_its_layers_resident(tiny_pair, tmp_path):  # noqa: F811
    target, _ = tiny_pair
    kwargs = dict(dtype="float32", ssm=[1, "ngram"], tree="2,1", adaptive_tree=False)
    resident = _run(target, GREEDY, **kwargs)
    with Engine(target, offload="disk", offload_dir=tmp_path, **kwargs) as engine:
        assert engine.runner.streamer.order == [1, 2]
        assert _ids(engine.generate(PROMPTS, GREEDY)) == resident


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_cuda_offload_is_bit_identical_to_resident(tiny_pair, tmp_path, mode):  # noqa: F811
    target, other = tiny_pair
    for kwargs in ({}, dict(SPEC, ssm=[other, "ngram"])):
        for params in (GREEDY, SEEDED):
            resident = _run(target, params, dtype="float32", device="cuda", **kwargs)
            streamed = _run(target, params, dtype="float32", device="cuda", offload=mode,
                            offload_dir=tmp_path, **kwargs)  # fmt: skip
            assert streamed == resident


@pytest.mark.slow
def test_smollm_disk_offload_is_bit_identical(smollm_gguf, tmp_path):
    kwargs = dict(ssm=["default", "ngram"], max_batch_size=4)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    with Engine(smollm_gguf, **kwargs) as engine:
        resident = _ids(engine.generate(prompts, params))
    with Engine(smollm_gguf, offload="disk", offload_dir=tmp_path, **kwargs) as engine:
        assert _ids(engine.generate(prompts, params)) == resident
