"""The arena and the device-to-host offload, without an engine.

``arena_examples`` is also run against every mutant of the arena
(``test_capture_mutants.py``).
"""

from __future__ import annotations

import gc
import io
import os
import subprocess
import sys

import pytest

from eagle3_compat import arena as arena_mod
from eagle3_compat import capture
from eagle3_compat.capture import CaptureError

torch = pytest.importorskip("torch")


def _random_bits(shape, dtype, seed):
    """Arbitrary bit patterns of ``dtype`` (finite or not): a dtype mix-up cannot hide."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(shape).prod()) * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(*shape)


def arena_examples(core=capture, arena=arena_mod, directory=None):
    lengths, hidden = [5, 1, 300], 7
    for name in ("bfloat16", "float16", "float32"):
        dtype = getattr(torch, name)
        layout = arena.layout_for(lengths, 2, hidden, name)
        # regions: inside their page-aligned block, never overlapping, all inside total
        spans = sorted(layout.region(i, j) for i in range(3) for j in range(2))
        assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert spans[0][0] >= arena.NONCE_BYTES and spans[-1][0] + spans[-1][1] <= layout.total
        assert all(layout.block(i)[0] % arena.PAGE == 0 for i in range(3))
        assert layout.region(2, 1)[1] == 300 * hidden * dtype.itemsize
        # a block of many pages ends before the next one starts
        big = arena.layout_for([3000, 5], 2, hidden, name)
        (o0, n0), (o1, _n1) = big.block(0), big.block(1)
        assert o1 >= o0 + n0 and n0 > 2 * arena.PAGE, (big.block(0), big.block(1))
        data = [[_random_bits((n, hidden), dtype, 10 * i + j) for j in range(2)] for i, n in enumerate(lengths)]

        # the RPC path: a safetensors payload, every tensor back bit for bit
        sink = arena.LocalSink(layout, dtype, hidden)
        for i, per in enumerate(data):
            for j, t in enumerate(per):
                sink.write(i, j, 0, 2, t[:2]) if lengths[i] > 2 else sink.write(i, j, 0, lengths[i], t)
                if lengths[i] > 2:
                    sink.write(i, j, 2, lengths[i] - 2, t[2:])
        back = arena.tensors_from_payload(sink.payload(), layout, name, hidden)
        for i, per in enumerate(data):
            for j, t in enumerate(per):
                assert back[i][j].dtype == dtype
                assert torch.equal(back[i][j].view(torch.uint8), t.view(torch.uint8)), (name, i, j)

        # the shared-memory path
        d = arena.DriverArena(layout, **({} if directory is None else {"directory": str(directory)}))
        spec = d.spec()
        shm = arena.ShmSink.open(spec, layout, dtype, hidden)
        assert not isinstance(shm, str), shm
        for i, per in enumerate(data):
            for j, t in enumerate(per):
                shm.write(i, j, 0, lengths[i], t)
        shm.close()
        d.unlink()
        assert not os.path.exists(spec["path"])
        out = d.tensors(name, hidden)
        for i, per in enumerate(data):
            for j, t in enumerate(per):
                assert out[i][j].dtype == dtype and out[i][j].shape == t.shape
                assert torch.equal(out[i][j].view(torch.uint8), t.view(torch.uint8)), (name, i, j)
                # its storage is its own rows: torch.save writes this tensor only
                assert out[i][j].untyped_storage().nbytes() == t.numel() * dtype.itemsize

    # every write is checked: count, width, dtype, bounds
    layout = arena.layout_for([4], 1, 3, "float32")
    sink = arena.LocalSink(layout, torch.float32, 3)
    with pytest.raises(CaptureError, match=r"shape \(1, 3\), expected \[2, 3\]"):
        sink.write(0, 0, 0, 2, torch.zeros(1, 3))  # would broadcast one row over two
    with pytest.raises(CaptureError, match=r"shape \(2, 1\)"):
        sink.write(0, 0, 0, 2, torch.zeros(2, 1))  # would broadcast one column
    with pytest.raises(CaptureError, match="captured torch.float64, expected torch.float32"):
        sink.write(0, 0, 0, 2, torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(CaptureError, match=r"positions 3..4 do not fit a prompt of 4"):
        sink.write(0, 0, 3, 2, torch.zeros(2, 3))

    # a payload that is not this call's is refused
    other = arena.LocalSink(arena.layout_for([4, 2], 1, 3, "float32"), torch.float32, 3).payload()
    with pytest.raises(CaptureError, match="do not match this call"):
        arena.tensors_from_payload(other, layout, "float32", 3)
    with pytest.raises(CaptureError, match=r"expected torch.bfloat16"):
        arena.tensors_from_payload(sink.payload(), layout, "bfloat16", 3)

    # the worker recognises the driver's file, and only it
    d = arena.DriverArena(layout, **({} if directory is None else {"directory": str(directory)}))
    try:
        wrong = dict(d.spec(), nonce="00" * arena.NONCE_BYTES)
        assert "nonce differs" in arena.ShmSink.open(wrong, layout, torch.float32, 3)
        gone = dict(d.spec(), path=d.spec()["path"] + "-elsewhere")
        assert "cannot open" in arena.ShmSink.open(gone, layout, torch.float32, 3)
        with pytest.raises(CaptureError, match="disagree on the layout"):
            arena.ShmSink.open(dict(d.spec(), total=layout.total + 1), layout, torch.float32, 3)
    finally:
        d.discard()


    # a pool: a released file is leased again (same key), found in the worker's
    # cache without its name, and every write lands where it belongs
    kw = {} if directory is None else {"directory": str(directory)}
    pool = arena.ArenaPool(**kw)
    cache: dict = {}
    try:
        layout = arena.layout_for([3, 2], 1, 4, "float32")
        keys = []
        for round_ in range(2):
            lease = pool.lease(layout)
            spec = lease.spec()
            keys.append(spec["key"])
            shm = arena.ShmSink.open(spec, layout, torch.float32, 4, cache)
            assert not isinstance(shm, str), shm
            for i, n in enumerate(layout.lengths):
                shm.write(i, 0, 0, n, torch.full((n, 4), 10.0 * round_ + i))
            shm.close()
            lease.unlink()
            out = lease.tensors("float32", 4)
            assert [float(p[0][0].sum()) for p in out] == [40.0 * round_, 40.0 * round_ + 4], round_
            del out
            gc.collect()
        assert keys[0] == keys[1] and list(cache) == [keys[0]]
        # the worker refuses a kept mapping whose nonce is not the lease's
        lease = pool.lease(layout)
        bad = dict(lease.spec(), nonce="00" * arena.NONCE_BYTES)
        assert "nonce differs" in arena.ShmSink.open(bad, layout, torch.float32, 4, cache)
        with pytest.raises(CaptureError, match="for a layout of"):
            arena.ShmSink.open(dict(lease.spec(), capacity=layout.total - 1), layout, torch.float32, 4, cache)
        # a failed call's file is never leased again, and the worker is told to unmap it
        lease.discard()
        with pytest.raises(CaptureError, match="already given back"):
            lease.spec()
        assert pool.pop_forget() == [keys[0]]
        pool.close()
        with pytest.raises(CaptureError, match="pool is closed"):
            pool.lease(layout)
    finally:
        pool.close()
        arena.forget_all(cache)


def test_arena_examples():
    arena_examples()


def test_arena_in_dev_shm_leaves_nothing_and_stale_names_are_swept(tmp_path):
    mine = f"{arena_mod.PREFIX}{os.getpid()}-"  # other tox envs run side by side
    arena_examples()
    assert [n for n in os.listdir(arena_mod.SHM_DIR) if n.startswith(mine)] == []
    # a name left by a driver killed inside the arm RPC: its pid is gone
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"{arena_mod.PREFIX}{dead}-abc"
    alive = tmp_path / f"{arena_mod.PREFIX}{os.getpid()}-abc"
    stale.write_bytes(b"x")
    alive.write_bytes(b"x")
    assert arena_mod.sweep_stale(str(tmp_path)) == [stale.name]
    assert not stale.exists() and alive.exists()


def test_results_outlive_the_name_and_free_with_the_tensors():
    """The memory is the kernel's until the last mapping goes: after unlink the
    name is gone; tensors stay readable; dropping them returns the pages."""
    layout = arena_mod.layout_for([4096] * 4, 2, 1024, "float32")  # 128 MiB
    d = arena_mod.DriverArena(layout)
    key = d.spec()["key"]
    sink = arena_mod.ShmSink.open(d.spec(), layout, torch.float32, 1024)
    for i in range(4):
        for j in range(2):
            sink.write(i, j, 0, 4096, torch.full((4096, 1024), float(i * 2 + j)))
    sink.close()
    d.unlink()

    def mapped():
        # This process's mappings of the file (its pages are the kernel's until
        # the last one goes: no name, no descriptor left). Process-local, unlike
        # the machine's Shmem counter, which other test runs move.
        with open("/proc/self/maps") as fh:
            return sum(1 for line in fh if key in line)

    def descriptors():  # Python's mmap keeps a duplicate of the file's descriptor
        links = []
        for n in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{n}"))
            except OSError:  # listdir's own descriptor, closed by now
                pass
        return sum(1 for link in links if key in link)

    out = d.tensors("float32", 1024)
    assert mapped() >= 1 and not os.path.exists(os.path.join(arena_mod.SHM_DIR, key))
    assert float(out[3][1][17, 5]) == 7.0
    buf = io.BytesIO()
    torch.save(out[2][0], buf)
    assert buf.tell() < 4096 * 1024 * 4 + 4096  # one tensor's bytes, not the call's
    del out
    gc.collect()  # torch.save on torch 2.8 leaves a reference cycle around the saved storage
    # the last mapping and descriptor went with the tensors: so did the pages
    assert (mapped(), descriptors()) == (0, 0)


def test_offload_on_cpu_copies_what_it_does_not_own():
    from eagle3_compat.offload import HostOffload

    off = HostOffload("cpu")
    t = torch.arange(6.0).view(3, 2)
    owned = off.submit("a", t, owned=True)
    copied = off.submit("b", t, owned=False)
    t.add_(100)  # the model changes its tensor in place after the hook
    assert owned.wait() is t
    assert torch.equal(copied.wait(), torch.arange(6.0).view(3, 2))
    ran = []
    off.run(lambda: ran.append(1))
    assert ran == [1]  # inline on the CPU
    off.drain()
    off.close()


def test_offload_submit_into_checks_the_destination_and_copies():
    from eagle3_compat.offload import HostOffload

    off = HostOffload("cpu")
    rows = torch.arange(12, dtype=torch.float32).view(3, 4)
    dst = torch.zeros(3, 4)
    off.register(dst)()  # a no-op off CUDA
    assert torch.equal(off.submit_into(dst, rows).wait(), rows)
    assert torch.equal(dst, rows)
    for bad in (torch.zeros(1, 4), torch.zeros(3, 4, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="does not match"):
            off.submit_into(bad, rows)
    off.close()


def _allocated(fd):
    return os.fstat(fd).st_blocks * 512


def test_pool_reuses_released_files_and_frees_what_a_caller_does_not_keep():
    """The pool's memory: a file whose results are all released is reused by
    the next lease; a caller that keeps some results of a call keeps only
    their pages once the pool leases again; close() frees the kept files."""
    mib = 1 << 20
    layout = arena_mod.layout_for([1024] * 4, 2, 4096, "float32")  # 4 x 32 MiB
    pool = arena_mod.ArenaPool()
    cache: dict = {}

    def call(value):
        lease = pool.lease(layout)
        spec = lease.spec()
        fd = os.open(spec["path"], os.O_RDONLY) if spec["path"] else None  # to watch its pages
        sink = arena_mod.ShmSink.open(spec, layout, torch.float32, 4096, cache)
        for i in range(4):
            for j in range(2):
                sink.write(i, j, 0, 1024, torch.full((1024, 4096), value + i))
        sink.close()
        lease.unlink()
        return spec["key"], fd, lease.tensors("float32", 4096)

    try:
        key1, fd1, out = call(1.0)
        assert _allocated(fd1) >= layout.total
        del out
        gc.collect()
        assert pool.stats()["free_files"] == 1
        key2, fd2, out = call(2.0)
        assert key2 == key1 and fd2 is None  # the same file, mapped already
        assert [float(p[1][5, 7]) for p in out] == [2.0, 3.0, 4.0, 5.0]
        kept = out[2][1]
        del out
        gc.collect()
        assert float(kept[0, 0]) == 4.0
        assert pool.stats()["free_files"] == 0  # one prompt still held
        key3, fd3, out = call(3.0)
        assert key3 != key1
        # the held file now holds only the kept prompt's pages (+ its header page)
        assert _allocated(fd1) < layout.block(0)[1] + 2 * 4096 + 64 * 1024, _allocated(fd1) / mib
        assert float(kept[5, 5]) == 4.0 and float(out[2][1][5, 5]) == 5.0
        del out, kept
        gc.collect()
        assert pool.stats()["free_files"] == 2
        pool.close()
        arena_mod.forget_all(cache)
        assert pool.stats() == {"leased_bytes": 0, "free_bytes": 0, "free_files": 0, "files_made": 2}
        assert _allocated(fd1) > 0  # our own fd still pins the pages; the pool holds none
    finally:
        pool.close()
        arena_mod.forget_all(cache)
        for fd in (fd1, fd3):
            os.close(fd)


def test_pool_keep_bytes_zero_frees_at_release_and_bad_settings_are_named(monkeypatch):
    layout = arena_mod.layout_for([8], 1, 4, "float32")
    pool = arena_mod.ArenaPool(keep_bytes=0)
    lease = pool.lease(layout)
    key = lease.spec()["key"]
    lease.unlink()
    out = lease.tensors("float32", 4)
    del out
    gc.collect()
    assert pool.stats()["free_files"] == 0 and pool.pop_forget() == [key]
    monkeypatch.setenv(arena_mod.POOL_ENV, "12345")
    assert arena_mod.pool_keep_bytes() == 12345
    monkeypatch.setenv(arena_mod.POOL_ENV, "lots")
    with pytest.raises(ValueError, match="EAGLE3_COMPAT_ARENA_POOL_BYTES must be 'auto' or a number"):
        arena_mod.pool_keep_bytes()


def test_pipeline_stages_on_two_transports_are_merged_by_layer(tmp_path):
    """What a stage on another host gives (README, pipeline parallel): stage 0
    writes its layer slots to the driver's arena, stage 1 (which could not map
    it) sends its slots as a payload; collect_results puts every slot in its
    place, bit for bit, and refuses a payload that lacks one of the stage's
    slots."""
    from eagle3_compat.generator import collect_results

    prompts = [[4, 5, 6, 7, 8], [9], [10, 11, 12]]
    layer_ids, hidden, name = [5, 0, 2, 3], 4, "float32"
    dtype = torch.float32
    layout = arena_mod.layout_for([len(p) for p in prompts], len(layer_ids), hidden, name)
    g = torch.Generator().manual_seed(3)
    data = [[torch.randn(len(p), hidden, generator=g) for _j in range(4)] for p in prompts]  # finite
    stage_slots = {0: [1, 2], 1: [0, 3]}
    segments = [[i, 0, len(p), list(p)] for i, p in enumerate(prompts)]

    def cap(stage, transport, payload=None):
        return {"stage": stage, "slots": stage_slots[stage], "segments": segments, "transport": transport,
                "payload": payload, "steps": 1, "foreign_rows": 0, "error": None, "token_ids_checked": True,
                "dtype": name, "hidden_size": hidden}

    def run(payload_slots):
        d = arena_mod.DriverArena(layout, directory=str(tmp_path))
        shm = arena_mod.ShmSink.open(d.spec(), layout, dtype, hidden)
        local = arena_mod.LocalSink(layout, dtype, hidden)
        for i, p in enumerate(prompts):
            for j in stage_slots[0]:
                shm.write(i, j, 0, len(p), data[i][j])
            for j in stage_slots[1]:
                local.write(i, j, 0, len(p), data[i][j])
        shm.close()
        d.unlink()
        merged = capture.merge_stage_captures(
            [cap(0, "shm"), cap(1, "rpc", local.payload(payload_slots))], layer_ids)
        assert merged["transport"] == "mixed"
        return collect_results(prompts, layer_ids, layout, d, merged, call=0)

    got = run(stage_slots[1])
    for i in range(len(prompts)):
        for j in range(4):
            assert torch.equal(got[i][j].view(torch.uint8), data[i][j].view(torch.uint8)), (i, j)
    with pytest.raises(CaptureError, match="do not match this call's prompts and layers"):
        run([0])  # stage 1's payload lacks slot 3 (layer 3)
    assert not list(tmp_path.iterdir())
