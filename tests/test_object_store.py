"""Run directories on object stores (issue 22 item 1): work_dir and out_dir as fsspec URLs.

Against a real S3-compatible server the suite starts on localhost (moto's server mode,
through s3fs, credentials given to the s3fs client only, as storage_options): training,
checkpointing and an exact resume, the logs in the bucket; a process killed inside the
multipart upload of a checkpoint, then resumed exactly from the previous good one, the
partial upload never listed; the lock (a lease) refusing a second run and taken over once
its dead holder's lease ended (a stand-in clock); a rolled-back manifest and orphans as on a
local disk; every checksum checked against the bucket's own bytes. memory:// and file://
too. Kills are injected at a chosen point (a patched client call), never timed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import orjson
import pytest
import torch
from helpers import make_batches, make_model, mse_loss, plain_losses, read_jsonl

import ftrain
import ftrain.persist.store as store
from ftrain.errors import CheckpointError
from ftrain.persist import lease
from ftrain.persist.location import StoreURL
from ftrain.persist.manifest import Manifest
from ftrain.persist.rundir import RunDir
from ftrain.persist.store import Staging, StoreConflict, StoreDir

s3fs = pytest.importorskip("s3fs", reason="the s3 extra: pip install 'ftrain[s3]'")
moto_server = pytest.importorskip("moto.server", reason="the test extra: moto[server]")

TESTS = Path(__file__).parent
ROOT = TESTS.parent
SCRIPT = TESTS / "store_train.py"
sys.path.insert(0, str(TESTS))
import store_train  # noqa: E402


# ------------------------------------------------------------------ the S3 server
@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on a free localhost port, for the session."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    werkzeug = logging.getLogger("werkzeug")
    level = werkzeug.level
    werkzeug.setLevel(logging.ERROR)  # no line per request
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()
    werkzeug.setLevel(level)


class Bucket:
    """A fresh bucket on the test server: URLs in it, and its objects read directly."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.options = store_train.options(endpoint)
        self.fs = s3fs.S3FileSystem(**self.options, use_listings_cache=False)
        self.name = f"t{uuid.uuid4().hex[:16]}"
        self.fs.call_s3("create_bucket", Bucket=self.name)

    def url(self, path: str) -> StoreURL:
        return StoreURL(f"s3://{self.name}/{path}", storage_options=self.options)

    def listing(self, path: str) -> list[str]:
        prefix = f"{self.name}/{path}/"
        return sorted(p[len(prefix) :] for p in self.fs.find(f"{self.name}/{path}"))

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(f"{self.name}/{path}")

    def write(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.name}/{path}", data)

    def manifest(self, path: str) -> dict:
        return orjson.loads(self.read(f"{path}/manifest.json"))

    def uploads(self) -> list[str]:
        """The keys of the multipart uploads begun and never completed."""
        return [u["Key"] for u in self.fs.list_multipart_uploads(self.name)]


@pytest.fixture
def bucket(s3_endpoint):
    return Bucket(s3_endpoint)


@pytest.fixture
def staging(tmp_path, monkeypatch):
    """A fresh staging area (its counters) under the test's directory."""
    monkeypatch.setenv("FTRAIN_STAGING_DIR", str(tmp_path / "staging"))
    area = Staging()
    area.sizes = []  # every file staged
    add = area.add

    def record(path):
        area.sizes.append(path.stat().st_size)
        add(path)

    area.add = record
    monkeypatch.setattr(store, "STAGING", area)
    return area


# ------------------------------------------------------------------ runs
def new_state(seed=0):
    model = make_model(seed)
    return ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.05))


def loop(work_dir, hooks, *, resume=None, n=6, **kw):
    return ftrain.Loop(ftrain.make_step(mse_loss), new_state(), make_batches(n), hooks,
                       work_dir=work_dir, resume=resume, **kw)  # fmt: skip


def plain_params(n=6, epochs=2):
    """The parameters after the same training in a plain PyTorch loop (the reference)."""
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(epochs):
        for batch in make_batches(n):
            opt.zero_grad()
            mse_loss(model, batch).backward()
            opt.step()
    return [p.detach() for p in model.parameters()]


def same(state, expected):
    got = [p.detach() for p in state.model.parameters()]
    return all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def stop_at(step):
    def stop(events):
        for ev in events:
            yield ev
            if isinstance(ev, ftrain.events.StepEnd) and ev.state.step == step:
                raise KeyboardInterrupt

    return ftrain.hook(stop, priority="HIGH")


def logger():
    return ftrain.LoggerHook(every=1, progress=False, console=False)


# ------------------------------------------------------------------ S3: train, resume
def test_s3_run_checkpoints_resumes_bitwise_exact_and_keeps_its_logs_in_the_bucket(bucket, staging):
    url = bucket.url("run")

    def hooks():
        return [ftrain.CheckpointHook(2, max_keep=2), ftrain.hooks.AutoCheckpointHook(), logger()]

    first = loop(url, [*hooks(), stop_at(5)])
    with pytest.raises(KeyboardInterrupt):
        first.run()
    objects = bucket.listing("run")
    assert [o for o in objects if not o.startswith("tb/")] == [
        "interrupted.pth", "iter_2.pth", "iter_4.pth", "manifest.json", "metrics.jsonl",
    ]  # fmt: skip  # the lock released, nothing staged left behind
    assert any(o.startswith("tb/events.out.tfevents") for o in objects)
    for e in bucket.manifest("run")["files"]:  # the recorded checksums are the objects'
        data = bucket.read(f"run/{e['name']}")
        assert (e["size"], e["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())

    lp = loop(url, hooks(), resume="auto", epochs=2)
    end = lp.run()
    assert str(lp.resumed_from) == f"{url}/interrupted.pth"
    assert same(end, plain_params())  # bitwise: a plain PyTorch loop over the same batches
    records = [orjson.loads(line) for line in bucket.read("run/metrics.jsonl").splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))  # cut back to step 5, continued
    assert [r["loss"] for r in records] == pytest.approx(
        plain_losses(make_batches(6), epochs=2, lr=0.05), rel=1e-6
    )
    assert bucket.listing("run")[:3] == ["iter_10.pth", "iter_12.pth", "manifest.json"]
    assert lp.log_dir is None and staging.live == 0  # the local copies are gone
    assert 0 < staging.peak == max(staging.sizes)  # one checkpoint staged at a time


def test_a_save_waits_for_the_previous_upload_so_staging_holds_one_checkpoint(bucket, staging,
                                                                              monkeypatch):  # fmt: skip
    """The upload of iter_2 is held until the training thread has asked for iter_4's save:
    the save must wait for it (one checkpoint staged) rather than stage a second one."""
    asked = threading.Event()
    real_save, real_upload = ftrain.persist.checkpointer.Checkpointer.save, StoreDir.upload
    order = []

    def save(self, snapshot, directory, name, *args, **kwargs):
        if name == "iter_4.pth":
            asked.set()
        return real_save(self, snapshot, directory, name, *args, **kwargs)

    def upload(self, local, name):
        if name == "iter_2.pth":
            assert asked.wait(60), "the save of iter_4 never came"
        order.append((name, staging.live))
        return real_upload(self, local, name)

    monkeypatch.setattr(ftrain.persist.checkpointer.Checkpointer, "save", save)
    monkeypatch.setattr(StoreDir, "upload", upload)
    loop(bucket.url("run"), [ftrain.CheckpointHook(2, background=True)], max_steps=4).run()
    sizes = {e["name"]: e["size"] for e in bucket.manifest("run")["files"]}
    assert order == [("iter_2.pth", sizes["iter_2.pth"]), ("iter_4.pth", sizes["iter_4.pth"])]
    assert staging.peak == max(sizes.values()) and staging.live == 0


def test_a_corrupt_object_is_caught_by_its_sha256_and_resume_takes_the_previous(bucket):
    url = bucket.url("run")
    loop(url, [ftrain.CheckpointHook(2, max_keep=None)]).run()
    data = bytearray(bucket.read("run/iter_6.pth"))
    data[len(data) // 2] ^= 0xFF  # one bit flipped, same size
    bucket.write("run/iter_6.pth", bytes(data))
    lp = loop(url, [ftrain.CheckpointHook(2, max_keep=None)], resume="auto", epochs=2)
    with pytest.warns(UserWarning, match=r"Skipping checkpoint s3://.*iter_6.pth: .*SHA-256"):
        end = lp.run()
    assert str(lp.resumed_from) == f"{url}/iter_4.pth"
    assert same(end, plain_params())


def test_a_kill_inside_an_upload_resumes_exactly_from_the_previous_good_checkpoint(
    bucket, tmp_path, monkeypatch
):
    url = bucket.url("run")
    args = [sys.executable, str(SCRIPT), bucket.endpoint, str(url), "kill:iter_6.pth"]
    done = subprocess.run(args, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == store_train.KILLED, done.stdout + done.stderr[-3000:]
    assert bucket.uploads() == ["run/iter_6.pth"]  # its first part is on the server...
    assert "iter_6.pth" not in bucket.listing("run")  # ...and the object is not
    assert [e["name"] for e in bucket.manifest("run")["files"]] == ["iter_2.pth", "iter_4.pth"]
    assert [str(p) for p, _ in [ftrain.checkpoint.find_resumable(url)]] == [f"{url}/iter_4.pth"]

    later = time.time() + lease.LEASE + 1
    monkeypatch.setattr(lease, "now", lambda: later)  # restarted once the dead run's lease ended
    lp = store_train.build(url, resume="auto")
    with pytest.warns(UserWarning, match="Took over the lock"):
        end = lp.run()
    assert str(lp.resumed_from) == f"{url}/iter_4.pth"
    straight = store_train.build(tmp_path / "straight", resume=None).run()
    for a, b in zip(end.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert bucket.uploads() == []  # the cut-off upload was aborted by the next run
    assert [n for n in bucket.listing("run") if n.endswith(".pth")] == [
        "iter_2.pth", "iter_4.pth", "iter_6.pth", "iter_8.pth",
    ]  # fmt: skip


# ------------------------------------------------------------------ the lock
def test_a_second_run_is_refused_while_the_lock_is_held_and_takes_over_a_dead_holders(
    bucket, tmp_path, monkeypatch
):
    url = bucket.url("run")
    holder = subprocess.Popen(
        [sys.executable, str(SCRIPT), bucket.endpoint, str(url), "hold"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = holder.stdout.readline()
        assert line.startswith("HOLDING"), line + holder.stderr.read()[-3000:]
        with pytest.raises(CheckpointError, match=rf"is in use by another run \(pid {holder.pid} "
                           rf"on .*work_dir {url}; its lease ends in"):  # fmt: skip
            store_train.build(url).run()
    finally:
        holder.kill()
        holder.communicate()
    with pytest.raises(CheckpointError, match="is in use by another run"):
        store_train.build(url).run()  # dead, but its lease has not ended yet
    later = time.time() + lease.LEASE + 1
    monkeypatch.setattr(lease, "now", lambda: later)
    lp = store_train.build(url)
    with pytest.warns(UserWarning, match=rf"Took over the lock of {url} from pid {holder.pid}"):
        end = lp.run()
    assert str(lp.resumed_from) == f"{url}/iter_4.pth"
    assert ".ftrain.lock" not in bucket.listing("run")  # released at the end
    straight = store_train.build(tmp_path / "straight", resume=None).run()
    for a, b in zip(end.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.fixture(params=["s3", "memory"])
def store_url(request, s3_endpoint):
    """A fresh directory on S3 (conditional puts) or in memory:// (the fallback)."""
    if request.param == "s3":
        return Bucket(s3_endpoint).url("run")
    return StoreURL(f"memory://{uuid.uuid4().hex[:12]}/run")


def test_a_lost_lease_is_noticed_by_its_holder_and_never_deleted_by_it(store_url, monkeypatch):
    first = RunDir(store_url).lock("work_dir A")
    first.acquire()
    later = time.time() + lease.LEASE + 1
    monkeypatch.setattr(lease, "now", lambda: later)  # the first holder stalled past its lease
    second = RunDir(store_url).lock("work_dir B")
    with pytest.warns(UserWarning, match="Took over the lock"):
        second.acquire()
    assert first.renew() is False and "took the lock over" in first.lost
    with pytest.raises(CheckpointError, match="no longer holds the lock"):
        first.check()
    first.release()
    assert b"work_dir B" in RunDir(store_url).read_bytes(".ftrain.lock")  # not deleted by A
    second.release()
    assert RunDir(store_url).read_bytes(".ftrain.lock") is None


def test_a_manifest_put_is_conditional_on_the_version_read(store_url):
    loop(store_url, [ftrain.CheckpointHook(2)], max_steps=2).run()
    stale, other = Manifest(RunDir(store_url)), Manifest(RunDir(store_url))
    other.remove("iter_2.pth")  # another writer's manifest put
    with pytest.raises(StoreConflict, match="changed since this run read it"):
        stale.write()
    assert Manifest(RunDir(store_url)).entries == []  # the newer manifest stands


def test_a_run_whose_lock_was_taken_over_stops_before_its_next_save(bucket, monkeypatch):
    url = bucket.url("run")
    lp = loop(url, [ftrain.CheckpointHook(2, background=False)], max_steps=4)
    lp.run(steps=2)  # iter_2 saved; paused with the lock held
    later = time.time() + lease.LEASE + 1
    monkeypatch.setattr(lease, "now", lambda: later)  # it stalled past its lease
    other = RunDir(url).lock("work_dir of another run")
    with pytest.warns(UserWarning, match="Took over"):
        other.acquire()
    with pytest.raises(CheckpointError, match=r"no longer holds the lock of .* now names pid "
                       r".*work_dir of another run"):  # fmt: skip
        lp.run()
    assert [e["name"] for e in bucket.manifest("run")["files"]] == ["iter_2.pth"]
    assert "iter_4.pth" not in bucket.listing("run")  # nothing written after the takeover
    other.release()


# ------------------------------------------------------------------ manifests and orphans
def test_a_rolled_back_manifest_is_detected_and_newer_checkpoints_never_overwritten(bucket):
    url = bucket.url("run")

    def hooks():
        return [ftrain.CheckpointHook(2, max_keep=None)]

    loop(url, hooks(), max_steps=2).run()
    old = bucket.read("run/manifest.json")  # a copy taken at step 2
    loop(url, hooks(), resume="auto", max_steps=6).run()
    newer = {n: bucket.read(f"run/{n}") for n in ("iter_4.pth", "iter_6.pth")}
    bucket.write("run/manifest.json", old)  # the copy restored over the newer manifest
    with pytest.warns(UserWarning, match="is older than checkpoints"):
        with pytest.raises(CheckpointError, match=r"holds checkpoints of another run.*iter_6"):
            loop(url, hooks()).run()  # a fresh run would write iter_2... over them
    assert {n: bucket.read(f"run/{n}") for n in newer} == newer
    bucket.write("run/manifest.json", old)
    lp = loop(url, hooks(), resume="auto", epochs=2)
    with pytest.warns(UserWarning, match=r"manifest.json \(generation 1\) is older than .*"
                      r"iter_4.pth \(step 4, generation 2\), iter_6.pth"):  # fmt: skip
        end = lp.run()
    assert str(lp.resumed_from) == f"{url}/iter_6.pth"
    assert same(end, plain_params())
    assert [e["name"] for e in bucket.manifest("run")["files"]] == [
        f"iter_{n}.pth" for n in range(2, 13, 2)
    ]


class Killed(BaseException):
    """Stands for SIGKILL at a chosen point: nothing of the run's cleanup may save it."""


def test_orphans_of_this_run_are_collected_and_other_files_never(bucket, monkeypatch):
    url = bucket.url("run")
    real = StoreDir.delete

    def delete(self, name):
        if name == "iter_1.pth":
            raise Killed  # after the manifest that dropped iter_1 was put
        real(self, name)

    monkeypatch.setattr(StoreDir, "delete", delete)
    hooks = [ftrain.CheckpointHook(1, max_keep=2, background=False)]
    with pytest.raises(Killed):
        loop(url, hooks).run()
    monkeypatch.undo()
    assert [e["name"] for e in bucket.manifest("run")["files"]] == ["iter_2.pth", "iter_3.pth"]
    assert "iter_1.pth" in bucket.listing("run")  # an orphan
    bucket.write("run/notes.pth", b"not a checkpoint")  # an unknown file
    loop(bucket.url("elsewhere"), [ftrain.CheckpointHook(6)]).run()
    bucket.write("run/copied_iter_6.pth", bucket.read("elsewhere/iter_6.pth"))  # not this dir's
    end = loop(url, hooks, resume="auto", epochs=2).run()
    assert [n for n in bucket.listing("run") if n.endswith(".pth")] == [
        "copied_iter_6.pth", "iter_11.pth", "iter_12.pth", "notes.pth",
    ]  # fmt: skip
    assert same(end, plain_params())


# ------------------------------------------------------------------ memory://, file://
def test_memory_urls_train_and_resume_exactly():
    url = f"memory://{uuid.uuid4().hex[:12]}/run"
    with pytest.raises(KeyboardInterrupt):
        loop(url, [ftrain.CheckpointHook(2), ftrain.hooks.AutoCheckpointHook(), stop_at(3)]).run()
    lp = loop(url, [ftrain.CheckpointHook(2), ftrain.hooks.AutoCheckpointHook()], resume="auto",
              epochs=2)  # fmt: skip
    assert same(lp.run(), plain_params()) and str(lp.resumed_from) == f"{url}/interrupted.pth"
    assert type(RunDir(url)) is StoreDir


def test_file_urls_are_plain_paths(tmp_path):
    by_url = loop(f"file://{tmp_path}/a", [ftrain.CheckpointHook(2), logger()])
    by_path = loop(tmp_path / "b", [ftrain.CheckpointHook(2), logger()])
    assert by_url.work_dir == tmp_path / "a" and type(RunDir(f"file://{tmp_path}/a")) is RunDir
    by_url.run(), by_path.run()
    files = {d: sorted(p.name for p in (tmp_path / d).iterdir()) for d in "ab"}
    assert files["a"] == files["b"] and "iter_6.pth" in files["a"]
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "a" / "metrics.jsonl")] == [
        (r["step"], r["loss"]) for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")
    ]


# ------------------------------------------------------------------ the public functions
def test_load_find_and_export_accept_urls(bucket):
    url = bucket.url("run")
    trained = loop(url, [ftrain.CheckpointHook(3)]).run()
    expected = {k: v.clone() for k, v in trained.model.state_dict().items()}
    path, saved = ftrain.checkpoint.find_resumable(url)
    assert str(path) == f"{url}/iter_6.pth" and saved["state"]["step"] == 6
    assert ftrain.checkpoint.load_checkpoint(path)["state"]["step"] == 6
    model = make_model(1)
    assert ftrain.checkpoint.load_weights(model, path) == ([], [])
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    out = ftrain.checkpoint.export_weights(path, bucket.url("export"), max_shard_size=200)
    assert [str(u) for u in out] == [
        f"{bucket.url('export')}/model-00001-of-00003.safetensors",
        f"{bucket.url('export')}/model-00002-of-00003.safetensors",
        f"{bucket.url('export')}/model-00003-of-00003.safetensors",
        f"{bucket.url('export')}/model.safetensors.index.json",
    ]
    again = make_model(2)
    assert ftrain.checkpoint.load_weights(again, bucket.url("export"), strict=True) == ([], [])
    assert all(torch.equal(v, expected[k]) for k, v in again.state_dict().items())


# ------------------------------------------------------------------ errors
def test_plain_url_strings_use_the_environments_credentials(bucket, monkeypatch):
    """No storage_options: s3fs finds the credentials and the endpoint in the environment
    (set for this test only)."""
    loop(bucket.url("run"), [ftrain.CheckpointHook(6)]).run()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.endpoint)
    s3fs.S3FileSystem.clear_instance_cache()  # made now, from this environment
    try:
        saved = ftrain.checkpoint.load_checkpoint(f"s3://{bucket.name}/run/iter_6.pth")
        lp = loop(f"s3://{bucket.name}/run", [], resume="auto", epochs=2)
        end = lp.run()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert saved["state"]["step"] == 6 and str(lp.resumed_from).endswith("run/iter_6.pth")
    assert same(end, plain_params())


def test_a_missing_s3fs_is_named_with_the_extra_that_brings_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"needs the s3fs package: pip install 'ftrain\[s3\]'"):
        loop("s3://bucket/run", [])
    with pytest.raises(ImportError, match=r"pip install 'ftrain\[s3\]'"):
        ftrain.checkpoint.load_checkpoint("s3://bucket/run/iter_2.pth")


def test_a_bucket_that_is_not_there_is_an_error_before_step_1(s3_endpoint):
    url = StoreURL("s3://no-such-bucket/run", storage_options=store_train.options(s3_endpoint))
    steps = []
    lp = loop(url, [ftrain.CheckpointHook(2), ftrain.hooks.on(ftrain.events.StepEnd, steps.append)])
    with pytest.raises(CheckpointError, match=r"Cannot write checkpoints to s3://no-such-bucket"
                       r"/run .*the bucket exists"):  # fmt: skip
        lp.run()
    assert steps == []


def test_storage_options_with_a_local_work_dir_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"Loop: work_dir=.* is a local path: storage_options="):
        loop(tmp_path, [], storage_options={"anon": True})


def test_staging_dir_is_where_checkpoints_wait_for_their_upload(tmp_path, monkeypatch):
    seen = []
    real = StoreDir.upload

    def upload(self, local, name):
        seen.append(Path(local).parent)
        return real(self, local, name)

    monkeypatch.setattr(StoreDir, "upload", upload)
    url = StoreURL(f"memory://{uuid.uuid4().hex[:12]}/run", staging_dir=str(tmp_path / "fast"))
    loop(url, [ftrain.CheckpointHook(6)]).run()
    assert seen == [tmp_path / "fast" / "ftrain-staging"]
    assert list((tmp_path / "fast" / "ftrain-staging").iterdir()) == []
    shutil.rmtree(tmp_path / "fast")


# ------------------------------------------------------------------ 2 processes
@pytest.mark.dist
def test_ddp_and_fsdp2_checkpoints_on_s3_resume_exactly_with_two_gloo_ranks(bucket, tmp_path):
    """DDP: rank 0's file and each rank's own, uploaded by their ranks; FSDP2: DCP's
    FsspecWriter puts every rank's shards under the checkpoint's prefix (background saves:
    DCP's async_save)."""
    url = bucket.url("dist")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(TESTS / "store_worker.py"), str(tmp_path), bucket.endpoint, url.url]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}"}  # fmt: skip
    proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for strategy, resumed in (("ddp", "iter_4.pth"), ("fsdp2", "iter_4.dcp")):
        for r in (0, 1):
            got = orjson.loads((tmp_path / f"store_{strategy}_rank{r}.json").read_bytes())
            assert got["diff"] == 0.0, (strategy, r, got)
            assert got["resumed_from"] == f"{url}/{strategy}/{resumed}"
        objects = orjson.loads((tmp_path / f"store_{strategy}_rank0.json").read_bytes())["objects"]
        if strategy == "ddp":
            assert {"iter_4.pth", "iter_4.pth.rank0", "iter_4.pth.rank1"} <= set(objects)
        else:
            assert {"iter_4.dcp/.metadata", "iter_4.dcp/ftrain.pth", "iter_4.dcp/rank0.pth",
                    "iter_4.dcp/rank1.pth"} <= set(objects)  # fmt: skip
            assert sum(o.startswith("iter_4.dcp/__") for o in objects) == 2  # a shard file a rank
        assert "manifest.json" in objects and ".ftrain.lock" not in objects


def test_docstring_examples():
    import doctest
    import importlib

    for name in ("location", "store", "lease", "mirror", "dcp_io", "rundir"):
        module = importlib.import_module(f"ftrain.persist.{name}")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, name


def test_a_retention_policy_keeps_its_set_on_s3(bucket):
    from ftrain.hooks.keep import keep_every, keep_latest

    url = bucket.url("keep")
    bucket.write("keep/notes.pth", b"a user's file")
    hooks = [ftrain.CheckpointHook(1, keep=keep_latest(1) | keep_every(4), background=False)]
    loop(url, hooks, n=6).run()
    assert [e["name"] for e in bucket.manifest("keep")["files"]] == ["iter_4.pth", "iter_6.pth"]
    assert bucket.listing("keep") == ["iter_4.pth", "iter_6.pth", "manifest.json", "notes.pth"]


def _dead_holders_lock(url: StoreURL, expires: float) -> dict:
    body = {"holder": "pid 1 on a-pod-that-died, work_dir", "token": "dead", "expires": expires,
            "lease": lease.LEASE}  # fmt: skip
    RunDir(url).write_bytes(".ftrain.lock", orjson.dumps(body))
    return body


def test_a_lease_its_holder_stopped_renewing_is_waited_out_then_taken(monkeypatch):
    """A restarted pod finds its former self's lock, not renewed for 50 s of a 60 s lease:
    it waits the 10 s left (a stand-in clock) and takes it over; a holder that renews while
    it waits is alive: refused, naming it."""
    clock = [1_000_000.0]
    monkeypatch.setattr(lease, "now", lambda: clock[0])
    monkeypatch.setattr(lease.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    url = StoreURL(f"memory://{uuid.uuid4().hex[:12]}/run")
    _dead_holders_lock(url, clock[0] + 10)
    lock = RunDir(url).lock("work_dir restarted")
    with pytest.warns(UserWarning, match=r"not been renewed for 50 s .*waiting 10 s"):
        lock.acquire()
    assert clock[0] >= 1_000_010 and b"work_dir restarted" in RunDir(url).read_bytes(".ftrain.lock")
    lock.release()

    body = _dead_holders_lock(url, clock[0] + 10)

    def renewing(s: float) -> None:  # the holder renews while the new run waits
        clock[0] += s
        RunDir(url).write_bytes(".ftrain.lock", orjson.dumps({**body, "expires": clock[0] + 60}))

    monkeypatch.setattr(lease.time, "sleep", renewing)
    with pytest.warns(UserWarning, match="waiting"), pytest.raises(
        CheckpointError, match="is in use by another run .*a-pod-that-died"
    ):
        RunDir(url).lock("work_dir second").acquire()
    # renewed lately (60 s left): refused at once, no waiting
    _dead_holders_lock(url, clock[0] + 60)
    with pytest.raises(CheckpointError, match="is in use by another run"):
        RunDir(url).lock("work_dir third").acquire()


def test_the_docs_page_runs(tmp_path, monkeypatch, capsys):
    """docs/object_stores.md's ``python`` blocks run as written (a memory:// run directory)."""
    page = (Path(__file__).parent.parent / "docs" / "object_stores.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/object_stores.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    found = namespace["ftrain"].checkpoint.find_resumable("memory://docs/run")
    assert str(found[0]) == "memory://docs/run/iter_6.pth"
    assert "memory://docs/run/iter_6.pth" in capsys.readouterr().out
