"""DeepSpeed's own engine.save_checkpoint and load_checkpoint after spillway.deepspeed.install(), on
the real DeepSpeed (CPU accelerator, Gloo, one process per run; workers/ds_checkpoint.py): a load
reads into the arena-backed tensors without a second copy of the state and leaves nothing behind,
saves stay flat, each file's CRC32C is in a manifest the load checks before it touches the engine,
a save killed at any point leaves `latest` naming the previous checkpoint, the format is
DeepSpeed's (plain DeepSpeed loads it and the reverse, zero_to_fp32 gives the same weights), and a
resumed run continues the uninterrupted one bit for bit (docs/deepspeed.md, Note [DeepSpeed
checkpoints])."""
import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import _zygote
import pytest

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install-deps installs 0.19.8)")
torch = pytest.importorskip("torch")

from _ranks import run_ranks  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "ds_checkpoint.py"
MIB = 1 << 20
# What a load may add to the anonymous RSS beyond the largest offloaded tensor: DeepSpeed's and
# torch.load's small objects (the pickled dicts, the loss scaler, the parameter groups).
SLACK = 8 * MIB
# What the O_DIRECT writer holds from the first save on, once per engine and process whatever the
# model (deepspeed/_direct_file.py): eight 4 MiB staging buffers (each an exact region of the
# pinned arena) and its eight handles' 1 MiB bounce buffers, which share one 32 MiB region.
DIRECT_FILES = 8 * 4 * MIB + 32 * MIB


def run(tmp_path, name, spec, expect_rc=0):
    """One worker process, from the zygote (_zygote.py). What the worker measures is RssAnon, its
    own anonymous pages, which pages shared with the zygote leave as a fresh process would have them:
    a shared page the child writes is copied in place of the one it mapped (no change in RSS)."""
    out = tmp_path / f"{name}.json"
    p = _zygote.run([sys.executable, str(WORKER), str(out), json.dumps(spec)], capture_output=True, text=True,
                    timeout=1200, cwd=WORKER.parent)
    assert p.returncode == expect_rc, f"{name}: exit {p.returncode}\n" + p.stdout[-3000:] + p.stderr[-6000:]
    return json.loads(out.read_text()) if expect_rc == 0 else None


class SharedSaves:
    """One save per stage and accelerator, made once and shared by the tests that only read it or
    damage a copy of it: 2 steps and a save as global_step2 through
    Spillway's checkpoint engine, then at the same state once more through DeepSpeed's own
    (`also_plain_dir`). Stage 3's serves the cross-load, zero_to_fp32 and every damaged-file test;
    two ranks' (`ranks=2`) both damaged-rank tests. A test that changes the files takes copy()."""

    def __init__(self, root):
        self.root, self.done = root, {}

    def get(self, stage, ranks=1):
        key = (stage, ranks, os.environ.get("DS_ACCELERATOR", "cpu"))
        if key not in self.done:
            d = self.root / "-".join(map(str, key))
            d.mkdir(parents=True)
            spec = {"stage": stage, "spillway": True, "saves": 1, "every": 2, "save_dir": str(d / "ours")}
            if ranks == 1:
                spec["also_plain_dir"] = str(d / "plain")
                self.done[key] = (run(d, "save", spec), d)
            else:
                self.done[key] = (run_two_ranks(d, "save", spec), d)
        return self.done[key]

    def copy(self, stage, into, ranks=1):
        """A copy of the checkpoint Spillway saved (its folder, `latest` and the manifests: they name
        the files relative to it, so the copy verifies as the original does)."""
        _, d = self.get(stage, ranks)
        shutil.copytree(d / "ours", into)
        return into


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    return SharedSaves(tmp_path_factory.mktemp("saves"))


def optim_file(directory):
    (f,) = [p for p in Path(directory).iterdir() if p.name.endswith("_optim_states.pt")]
    return f


@pytest.mark.parametrize("stage", [3, 2])
def test_a_load_copies_into_the_arena_tensors_and_leaves_nothing_behind(tmp_path, stage):
    params = 4e6
    spec = {"stage": stage, "params": params, "saves": 1, "every": 2, "tag": "t"}
    run(tmp_path, "save", {**spec, "spillway": True, "save_dir": str(tmp_path / "ckpt")})
    load = {"stage": stage, "params": params, "pre_steps": 1, "load_dir": str(tmp_path / "ckpt"), "load_tag": "t"}
    ours = run(tmp_path, "ours", {**load, "spillway": True})
    plain = run(tmp_path, "plain", load)
    for name, r in (("plain DeepSpeed", plain), ("spillway", ours)):
        print(f"ZeRO-{stage} {name}: offloaded state {r['state_bytes'] / MIB:.1f} MiB, largest tensor "
              f"{r['largest'] / MIB:.1f} MiB; load_checkpoint: RssAnon peak {r['load']['peak_over_before'] / MIB:+.1f} "
              f"MiB, left {r['load']['left'] / MIB:+.1f} MiB, RssFile peak "
              f"{r['load']['file_peak_over_before'] / MIB:+.1f} MiB")
    bound = ours["largest"] + SLACK
    assert ours["load"]["peak_over_before"] <= bound, ours["load"]
    assert ours["load"]["left"] <= SLACK, ours["load"]
    assert ours["audit"]["missed"] == [], ours["audit"]
    # The control: plain DeepSpeed's load holds the state read back with torch.load, over the bound.
    assert plain["load"]["peak_over_before"] > bound, plain["load"]


@pytest.mark.parametrize("stage", [3, 2])
def test_a_resumed_run_continues_the_uninterrupted_one_bit_for_bit(tmp_path, stage):
    # With the fused step (install()'s default): 3 steps, a save, a new process that loads it and
    # takes 3 more, against 6 steps in one process.
    base = {"stage": stage, "spillway": True}
    whole = run(tmp_path, "whole", {**base, "steps": 6})
    run(tmp_path, "first", {**base, "saves": 1, "every": 3, "save_dir": str(tmp_path / "ckpt")})
    resumed = run(tmp_path, "resumed", {**base, "load_dir": str(tmp_path / "ckpt"), "load_tag": None, "steps": 3})
    assert resumed["losses"] == whole["losses"][3:]
    assert resumed["digest"] == whole["digest"]


@pytest.mark.parametrize("stage", [3, 2])
def test_plain_deepspeed_loads_spillways_checkpoint_and_spillway_loads_plain_deepspeeds(tmp_path, stage, saves):
    # Spillway's save is the shared one (saves); plain DeepSpeed's is a run of its own, whose
    # process installs nothing.
    for saver, loader in ((True, False), (False, True)):
        if saver:
            saved, shared = saves.get(stage)
            d = shared / "ours"
        else:
            d = tmp_path / "saved-by-plain"
            saved = run(tmp_path, "save", {"stage": stage, "spillway": False, "saves": 1, "every": 2,
                                           "save_dir": str(d)})
        loaded = run(tmp_path, "load", {"stage": stage, "spillway": loader, "load_dir": str(d), "load_tag": None})
        assert loaded["digest"] == saved["digest"], f"saved by {'spillway' if saver else 'plain DeepSpeed'}"
        assert any(f.name.startswith("spillway-checkpoint-rank") for f in (d / "global_step2").iterdir()) == saver


def test_zero_to_fp32_gives_the_same_weights_from_either_engines_files(saves):
    # One run, saved through Spillway's checkpoint engine and then, at the same state, through
    # DeepSpeed's own (the worker swaps it in): DeepSpeed's offline converter reads both alike.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _, d = saves.get(3)
    ours = get_fp32_state_dict_from_zero_checkpoint(str(d / "ours"))
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(d / "plain"))
    assert set(ours) == set(theirs) and len(ours) > 2
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_every_file_of_a_save_is_a_zip_whose_records_check(saves):
    # torch computes no CRC-32 while Spillway's writer saves: the writer computes it as the bytes
    # pass and writes it in (deepspeed/_direct_file.py). Python's zipfile checks each record's
    # CRC-32 as it reads it, as zip tools do; DeepSpeed's own files, same state, are the control.
    _, d = saves.get(3)
    for which in ("ours", "plain"):
        files = sorted((d / which / "global_step2").glob("*.pt"))
        assert files, which
        for f in files:
            with zipfile.ZipFile(f) as z:
                assert z.testzip() is None, f
                assert all(i.CRC for i in z.infolist() if i.file_size), f


def test_twenty_saves_stay_flat(tmp_path):
    # Two steps first (the moments and the step's scratch exist), then a step and a save, twenty times.
    r = run(tmp_path, "saves", {"stage": 3, "spillway": True, "steps": 2, "saves": 20, "every": 1, "tag": "t",
                                "save_dir": str(tmp_path / "ckpt")})
    afters = [s["after"] for s in r["saves"]]
    peaks = [s["peak_over_before"] for s in r["saves"]]
    print(f"offloaded state {r['state_bytes'] / MIB:.1f} MiB, largest tensor {r['largest'] / MIB:.1f} MiB; RssAnon "
          f"after saves 1-20 (MiB over before the first): {', '.join(f'{a / MIB:+.1f}' for a in afters)}; peak during "
          f"each: {max(peaks) / MIB:+.1f} MiB at most")
    assert max(afters) - afters[0] <= 2 * MIB, afters
    assert peaks[0] <= r["largest"] + SLACK + DIRECT_FILES, peaks  # the first save makes the writer's buffers
    assert max(peaks[1:]) <= r["largest"] + SLACK, peaks


def corrupt(f):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))


def truncate(f):
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 4096)


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing"])
def test_bad_input_a_damaged_file_is_refused_naming_it_and_the_engine_is_left_as_it_was(tmp_path, damage, saves):
    d = saves.copy(3, tmp_path / "ckpt")
    victim = optim_file(d / "global_step2")
    {"corrupt": corrupt, "truncated": truncate, "missing": Path.unlink}[damage](victim)
    r = run(tmp_path, "load", {"stage": 3, "spillway": True, "pre_steps": 1, "load_dir": str(d), "load_tag": None,
                               "expect_error": "ChecksumMismatch"})
    print(r["error"])
    assert str(victim) in r["error"]
    assert {"corrupt": "CRC32C", "truncated": "truncated", "missing": "missing"}[damage] in r["error"]
    assert "nothing of the engine was changed" in r["error"]
    assert r["digest"] == r["digest_before_error"]


@pytest.mark.parametrize("kill_after_files", [1, 2])
def test_a_save_killed_midway_leaves_latest_naming_the_previous_checkpoint_which_loads(tmp_path, kill_after_files):
    # Two saves (global_step2, global_step4); the second is killed after its first file is in place,
    # or after both are (before the manifest and `latest`).
    d = tmp_path / "ckpt"
    run(tmp_path, "save", {"stage": 3, "spillway": True, "saves": 2, "every": 2, "save_dir": str(d),
                           "kill_after_files": kill_after_files}, expect_rc=-signal.SIGKILL)
    assert (d / "latest").read_text() == "global_step2"
    r = run(tmp_path, "load", {"stage": 3, "spillway": True, "load_dir": str(d), "load_tag": None, "steps": 1})
    assert len(r["losses"]) == 1
    # The killed save's directory, loaded by its tag, is refused: its manifest says in progress.
    from spillway import ChecksumMismatch
    from spillway.deepspeed._checkpoint import verify

    with pytest.raises(ChecksumMismatch, match="rank 0 did not finish.*in progress"):
        verify(str(d), "global_step4")


def test_a_tag_saved_again_and_killed_midway_keeps_its_previous_checkpoint(tmp_path):
    # A tag saved, then saved again by a later run (more steps: other state) that is killed after
    # both of its files are written, before its manifest says complete: the tag still loads, as the
    # first save wrote it.
    d = tmp_path / "ckpt"
    first = run(tmp_path, "first", {"stage": 3, "spillway": True, "saves": 1, "every": 2, "tag": "t", "save_dir": str(d)})
    run(tmp_path, "again", {"stage": 3, "spillway": True, "saves": 1, "every": 4, "tag": "t", "save_dir": str(d),
                            "kill_after_files": 2}, expect_rc=-signal.SIGKILL)
    r = run(tmp_path, "load", {"stage": 3, "spillway": True, "load_dir": str(d), "load_tag": "t"})
    assert r["digest"] == first["digest"]
    # A whole second save replaces it, and leaves no staging directory behind (the killed one's too).
    again = run(tmp_path, "whole", {"stage": 3, "spillway": True, "saves": 1, "every": 4, "tag": "t", "save_dir": str(d)})
    assert sorted(p.name for p in d.iterdir() if p.is_dir()) == ["t"] and (d / "latest").read_text() == "t"
    r = run(tmp_path, "load-again", {"stage": 3, "spillway": True, "load_dir": str(d), "load_tag": None})
    assert r["digest"] == again["digest"] != first["digest"]


def run_two_ranks(tmp_path, name, spec):
    """The worker on a Gloo group of two; every rank must exit 0 (an expected error raised on each)."""
    out = tmp_path / f"{name}.json"
    run_ranks([sys.executable, str(WORKER), str(out), json.dumps(spec)], cwd=WORKER.parent, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.parametrize("damaged_rank", [0, 1])
def test_bad_input_two_ranks_a_damaged_file_of_either_rank_is_refused_on_both(tmp_path, damaged_rank, saves):
    d = saves.copy(3, tmp_path / "ckpt", ranks=2)
    victim = d / "global_step2" / f"bf16_zero_pp_rank_{damaged_rank}_mp_rank_00_optim_states.pt"
    corrupt(victim)
    r = run_two_ranks(tmp_path, "load", {"stage": 3, "spillway": True, "pre_steps": 1, "load_dir": str(d),
                                         "load_tag": None, "expect_error": "ChecksumMismatch"})
    assert str(victim) in r["error"] and r["digest"] == r["digest_before_error"]


def test_bad_input_two_ranks_a_file_rank_1_cannot_write_fails_the_save_on_both_and_latest_is_not_written(tmp_path):
    # A real failure on rank 1 only: its optimizer file's name is taken by a directory, so the
    # rename that puts the file in place fails there.
    d = tmp_path / "ckpt"
    blocker = d / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    blocker.mkdir(parents=True)
    (blocker / "keep").write_text("x")
    r = run_two_ranks(tmp_path, "save", {"stage": 3, "spillway": True, "saves": 1, "every": 2, "save_dir": str(d),
                                         "expect_save_error": "IoError"})
    print(r["error"])
    assert "rank 1" in r["error"] and str(blocker) in r["error"]
    assert not (d / "latest").exists()
    # Rank 0's part is whole and has its manifest; rank 1's has none, and a load of the tag by name
    # is refused for it.
    from spillway import ChecksumMismatch
    from spillway.deepspeed._checkpoint import verify

    with pytest.raises(ChecksumMismatch, match="of the 2-rank save of rank 1 did not finish"):
        verify(str(d), "global_step2")


def test_use_node_local_storage_loads_each_nodes_part_from_its_own_directory(tmp_path):
    # DeepSpeed's checkpoint.use_node_local_storage, two nodes of one rank each: every rank saves to
    # and loads from a directory of its own, which holds its node's files and manifest only. The
    # load checks the manifests of the ranks that share the directory, not every rank's.
    d = tmp_path / "node{rank}"
    saved = run_two_ranks(tmp_path, "save", {"stage": 3, "spillway": True, "saves": 1, "every": 2, "node_local": True,
                                             "save_dir": str(d)})
    for rank in (0, 1):
        tag = tmp_path / f"node{rank}" / "global_step2"
        assert sorted(f.name for f in tag.glob("spillway-checkpoint-rank*")) == [f"spillway-checkpoint-rank{rank:05d}.json"]
        assert sorted(f.name for f in tag.glob("*.pt")) == [f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                                                            f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"]
    loaded = run_two_ranks(tmp_path, "load", {"stage": 3, "spillway": True, "node_local": True, "load_dir": str(d),
                                              "load_tag": "global_step2"})
    assert loaded["digests"] == saved["digests"] and saved["digests"][0] != saved["digests"][1]
    # A damaged file on node 1 is still found, and refused on both ranks.
    victim = tmp_path / "node1" / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    corrupt(victim)
    r = run_two_ranks(tmp_path, "refused", {"stage": 3, "spillway": True, "node_local": True, "pre_steps": 1,
                                            "load_dir": str(d), "load_tag": "global_step2",
                                            "expect_error": "ChecksumMismatch"})
    assert str(victim) in r["error"] and r["digest"] == r["digest_before_error"], r["error"]


def same_archive_but_its_id(got, want, what):
    """`got` is the archive `want` is, record for record at the same offsets, with the same CRC-32s,
    but for .data/serialization_id: torch makes it from the records' CRC-32s as it computes them,
    which it did not where Spillway's writer computed them (torch uses it for usage logging)."""
    import io

    assert len(got) == len(want), what
    with zipfile.ZipFile(io.BytesIO(got)) as g, zipfile.ZipFile(io.BytesIO(want)) as w:
        assert g.testzip() is None, what
        gi, wi = g.infolist(), w.infolist()
        assert [(i.filename, i.header_offset, i.file_size) for i in gi] == \
            [(i.filename, i.header_offset, i.file_size) for i in wi], what
        for a, b in zip(gi, wi):
            if not a.filename.endswith(".data/serialization_id"):
                assert (a.CRC, g.read(a)) == (b.CRC, w.read(b)), (what, a.filename)


@pytest.mark.parametrize("where", ["disk", "tmpfs", "buffered-by-choice"])
def test_the_direct_writer_writes_torch_saves_bytes_and_their_crc(tmp_path, where, monkeypatch):
    # The checkpoint files' writer (deepspeed/_direct_file.py): O_DIRECT on this disk, tmpfs (which
    # refuses O_DIRECT at open before Linux 6.6: then buffered), and buffered when
    # SPILLWAY_CHECKPOINT_DIRECT=0. Each file holds exactly what torch.save writes with its CRC-32
    # on (sizes around the staging buffers' and the O_DIRECT granule's edges), though torch computed
    # none (the writer did), with its CRC32C and length.
    import io

    import spillway
    from spillway.deepspeed._direct_file import _STAGES, STAGE_BYTES, DirectFiles

    base = Path("/dev/shm") if where == "tmpfs" else tmp_path
    if where == "tmpfs" and not base.is_dir():
        pytest.skip("no /dev/shm tmpfs here")
    if where == "buffered-by-choice":
        monkeypatch.setenv("SPILLWAY_CHECKPOINT_DIRECT", "0")
    if where == "disk":
        try:
            os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        except OSError as e:
            pytest.skip(f"the test directory's filesystem has no O_DIRECT ({e})")
    files = DirectFiles()
    # The last: past the ring's end, so a buffer is waited for and filled again.
    sizes = [0, 1, 4095, 4097, STAGE_BYTES - 7, 2 * STAGE_BYTES + 4096 * 3 + 5,
             (_STAGES + 1) * STAGE_BYTES + 4096 * 3 + 5]
    for i, n in enumerate(sizes):
        # A record whose bytes read as a data descriptor of an empty record, and an empty one.
        lookalike = torch.tensor([0x08074B50, 7, 0, 0], dtype=torch.int32)
        state = {"t": torch.arange(n // 4 + 1, dtype=torch.int32)[: n // 4], "tail": bytes(range(n % 4)), "i": i,
                 "lookalike": lookalike, "empty": torch.empty(0)}
        want = io.BytesIO()
        torch.save(state, want)
        path = base / f"spillway-direct-test-{os.getpid()}-{where}-{i}.pt"
        during = []

        def save(writer, state=state, during=during):
            torch.save(state, writer)
            during.append(torch.serialization.get_crc32_options())  # back on after the first write
        try:
            w = files.write(str(path), save, str(path))
            got = path.read_bytes()
        finally:
            path.unlink(missing_ok=True)
        same_archive_but_its_id(got, want.getvalue(), (where, n))
        assert (w.bytes, w.crc) == (len(got), spillway._spillway.crc32c(got)), (where, n)
        if where != "tmpfs":  # tmpfs takes O_DIRECT since Linux 6.6 and refuses it before
            assert w.direct == (where == "disk"), (where, n)
        assert w.zip is not None and not w.zip.failed, (where, n)  # its own CRC-32, no second write
        assert during == [True], (where, n)
    assert torch.serialization.get_crc32_options()  # back as it was



def test_an_archive_of_another_layout_is_written_again_with_torchs_crc(tmp_path, monkeypatch, caplog):
    # What the writer does where torch.save's archive is not the layout it computes the CRC-32 for
    # (a later torch): it says so once and writes the file again, and every later one, with torch's.
    import spillway.deepspeed._direct_file as direct

    monkeypatch.setattr(direct, "_layout_unknown", [])
    files, calls = direct.DirectFiles(), []

    def not_a_zip(writer):
        calls.append(torch.serialization.get_crc32_options())
        writer.write(b"not torch's archive")

    path = tmp_path / "f.pt"
    w = files.write(str(path), not_a_zip, str(path))
    assert calls == [False, True] and path.read_bytes() == b"not torch's archive" and w.zip is None
    assert "no local header at offset 0" in caplog.text and "written again" in caplog.text
    state = {"w": torch.arange(10.0)}
    files.write(str(path), lambda writer: torch.save(state, writer), str(path))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    assert torch.serialization.get_crc32_options() and caplog.text.count("written again") == 1


def test_a_record_written_in_two_parts_is_not_patched_and_the_file_is_written_again(tmp_path, monkeypatch):
    # The layout check's worst case: a record's data reaches the writer in two writes (torch 2.13
    # writes it in one), the second of which reads as that record's data descriptor, sizes and all.
    # The writer must not take it for one and change the data: the real descriptor then comes where
    # a header should, and the file is written again with torch's CRC-32, equal to torch's own.
    import io
    import struct

    import spillway.deepspeed._direct_file as direct

    monkeypatch.setattr(direct, "_layout_unknown", [])
    tail = struct.pack("<4sIII", b"PK\x07\x08", 7, 16, 16)
    state = {"t": torch.frombuffer(bytearray(b"\x01" * 16 + tail), dtype=torch.uint8)}

    class Split:
        def __init__(self, writer):
            self.writer = writer

        def write(self, data):
            view = memoryview(data).cast("B")
            if view.nbytes == 32 and bytes(view[16:]) == tail:
                return self.writer.write(view[:16]) + self.writer.write(view[16:])
            return self.writer.write(view)

        def flush(self):
            pass

    path = tmp_path / "split.pt"
    w = direct.DirectFiles().write(str(path), lambda writer: torch.save(state, Split(writer)), str(path))
    want = io.BytesIO()
    torch.save(state, want)
    assert w.zip is None and "no local header" in direct._layout_unknown[0]
    assert path.read_bytes() == want.getvalue()


def test_a_record_over_4_gib_takes_the_zip64_forms(tmp_path):
    # A ZeRO rank's flat fp32 partition is one record, often over 4 GiB: its descriptor is 24 bytes
    # and its sizes and offsets are in zip64 extra fields. Fed through the layout check alone (no
    # disk): the CRC-32s it writes in are the records' own, and its central directory checks. The
    # tensor is untouched memory, the zero page: it adds almost no resident memory.
    import spillway.deepspeed._direct_file as direct
    from spillway import _spillway

    big = torch.empty((4 << 30) + 1, dtype=torch.uint8)
    small = torch.ones(3)
    zc, out = direct._ZipCrc(), []

    class Sink:
        def write(self, data):
            view = memoryview(data).cast("B")
            got, whole = zc.feed(view)
            if whole:
                zc.data(got)
            return view.nbytes

        def flush(self):
            pass

    with direct._TorchCrcOff():
        torch.save({"big": big, "small": small}, Sink())
    zc.finish()
    assert not zc.failed
    sizes = {size: crc for _, size, crc in zc.records}
    assert sizes[big.numel()] == _spillway.crc32(big.numpy())
    assert sizes[12] == _spillway.crc32(small.numpy())


def test_overlapping_writes_leave_the_setting_as_the_first_one_found_it():
    # Two files written at once (two threads): the first done must not turn torch's CRC-32 back on
    # under the second, and the last done restores what was set before either (here: off).
    from spillway.deepspeed._direct_file import _TorchCrcOff

    try:
        for before in (False, True):
            torch.serialization.set_crc32_options(before)
            a, b = _TorchCrcOff(), _TorchCrcOff()
            a.__enter__()
            b.__enter__()
            a.__exit__(None, None, None)
            assert not torch.serialization.get_crc32_options(), before
            b.__exit__(None, None, None)
            a.release()  # a second release counts nothing
            assert torch.serialization.get_crc32_options() == before
    finally:
        torch.serialization.set_crc32_options(True)


def test_spillways_crc32_is_zlibs():
    import zlib

    from spillway import _spillway

    data = os.urandom((1 << 20) + 13)
    assert _spillway.crc32(b"123456789") == 0xCBF43926
    assert _spillway.crc32(data) == zlib.crc32(data)
    assert _spillway.crc32(data[777:], _spillway.crc32(data[:777])) == zlib.crc32(data)
