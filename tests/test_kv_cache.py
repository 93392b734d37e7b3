"""KV cache memory: zeroed, and on the CPU taken from the OS only where it is written."""

import sys

import pytest
import torch

from specinfer.kv_cache import KVCache, zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cache_memory_is_zero_where_freed_memory_is_handed_out_again(dtype):
    # Small blocks come back from malloc's heap as they were left: dirty some, free them, and
    # ask for the same sizes again.
    for _ in range(20):
        dirty = [torch.empty(3, 5, 7, dtype=dtype).fill_(7) for _ in range(8)]
        del dirty
        got = [zeros((3, 5, 7), dtype, "cpu") for _ in range(8)]
        assert all(t.shape == (3, 5, 7) and t.dtype == dtype and not t.any() for t in got)
    a, b = zeros((4, 16), dtype, "cpu"), zeros((4, 16), dtype, "cpu")
    a += 1  # writable, and each tensor its own memory
    assert a.sum() == 64 and not b.any()
    assert a.is_contiguous() and a.data_ptr() % 64 == 0
    assert zeros((0,), dtype, "cpu").shape == (0,)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_cache_takes_memory_only_where_it_is_written():
    # 8 layers x (K, V) x 16 MiB: 256 MiB of cache, of which one request's few slots get written.
    before = _resident_bytes()
    kv = KVCache(num_layers=8, rows=64, num_kv_heads=4, max_seq_len=512, head_dim=64,
                 dtype=torch.bfloat16)  # fmt: skip
    for layer in range(8):
        kv.k[layer][0, :, :10] = 1.0
        kv.v[layer][0, :, :10] = 2.0
    grown = _resident_bytes() - before
    assert grown < 32 * 2**20, f"a 256 MiB cache made {grown / 2**20:.0f} MiB resident"
    assert kv.k[7][0, :, :10].eq(1).all() and not kv.k[7][1:].any() and not kv.v[3][0, :, 10:].any()
