"""Weights out and in: safetensors files and Hugging Face directories (issue 22, item 3).

References: ``safetensors.torch.load_file``, ``huggingface_hub``'s shard split,
``transformers``' ``save_pretrained`` / ``from_pretrained``, and the tensors of the model
itself; under DDP and FSDP2 (torchrun, gloo) the one-process export of the checkpoint.
"""

from __future__ import annotations

import doctest
import filecmp
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import make_batches, make_model, mse_loss
from huggingface_hub import split_torch_state_dict_into_shards

import ftrain
import ftrain.checkpoint
from ftrain.errors import CheckpointError
from ftrain.transforms.ema import ema_state_dict

TESTS = Path(__file__).parent
WORKER = TESTS / "export_worker.py"
DOCS = TESTS.parent / "docs" / "export.md"


def trained(steps: int = 3, ema: bool = False, model: torch.nn.Module | None = None):
    """A state after ``steps`` AdamW updates on the helpers' MLP (with an EMA if asked)."""
    model = make_model(0) if model is None else model
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    step = ftrain.make_step(mse_loss)
    if ema:
        step = ftrain.with_ema(step, decay=0.5)
    for batch in make_batches(steps):
        state, _ = step(state, batch)
    return state


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------ files
def test_one_file_loads_with_safetensors(tmp_path):
    state = trained()
    files = ftrain.checkpoint.export_weights(state, tmp_path / "w.safetensors")
    assert files == [tmp_path / "w.safetensors"]
    assert_same(safetensors.torch.load_file(files[0]), state.model.state_dict())
    with safetensors.safe_open(files[0], "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]  # no temporary left


def test_shards_follow_hugging_face_split_and_index(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(16, 16) for _ in range(5)], torch.nn.Linear(16, 200)
    )
    weights = model.state_dict()
    size = 3000  # bytes: shards of several tensors; the 12.8 kB one alone, before the open shard
    files = ftrain.checkpoint.export_weights(model, tmp_path / "out", max_shard_size=size)
    reference = split_torch_state_dict_into_shards(
        dict(weights), filename_pattern="model{suffix}.safetensors", max_shard_size=size
    )
    assert reference.is_sharded and len(reference.filename_to_tensors) == 4
    assert [f.name for f in files] == [
        *reference.filename_to_tensors,
        "model.safetensors.index.json",
    ]
    for name, tensors in reference.filename_to_tensors.items():
        assert re.fullmatch(r"model-0000\d-of-00004\.safetensors", name)
        loaded = safetensors.torch.load_file(tmp_path / "out" / name)
        assert list(loaded) == sorted(tensors)
        assert_same(loaded, {k: weights[k] for k in tensors})
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == reference.tensor_to_filename
    assert index["metadata"] == {"total_size": reference.metadata["total_size"]}
    # read back whole by load_weights
    fresh = torch.nn.Sequential(
        *[torch.nn.Linear(16, 16) for _ in range(5)], torch.nn.Linear(16, 200)
    )
    assert ftrain.checkpoint.load_weights(fresh, tmp_path / "out", strict=True) == ([], [])
    assert_same(fresh.state_dict(), weights)


def test_size_strings_are_hugging_face_units():
    from ftrain.persist.safetensors_files import parse_size

    assert parse_size("50GB") == 50 * 10**9 and parse_size("200MB") == 2 * 10**8
    for bad in ("5 gigs", 0, -1, "0MB", True):
        with pytest.raises(ValueError, match="max_shard_size must be"):
            parse_size(bad)


def test_a_new_export_replaces_the_old_one_and_nothing_else(tmp_path):
    model = make_model(0)
    out = tmp_path / "out"
    ftrain.checkpoint.export_weights(model, out, max_shard_size=400)  # 2 shards + index
    (out / "tokenizer.json").write_text("{}")
    (out / "model-00009-of-00012.bin").write_text("not ours")
    ftrain.checkpoint.export_weights(model, out)
    assert sorted(os.listdir(out)) == [
        "model-00009-of-00012.bin",
        "model.safetensors",
        "tokenizer.json",
    ]
    ftrain.checkpoint.export_weights(model, out, max_shard_size=400)
    assert "model.safetensors" not in os.listdir(out)
    assert (out / "model.safetensors.index.json").is_file()


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    ftrain.checkpoint.export_weights(make_model(0), path)
    before = path.read_bytes()
    real = safetensors.torch.save_file

    def half_then_fail(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:100])  # a crash mid-write
        raise OSError("disk gone")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_fail)
    with pytest.raises(OSError, match="disk gone"):
        ftrain.checkpoint.export_weights(make_model(1), path)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["w.safetensors"]


# ------------------------------------------------------------------ tied weights
class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.body(self.emb(x)))


def test_tied_weights_are_written_once_and_load_through_the_tie(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    files = ftrain.checkpoint.export_weights(model, tmp_path / "tied.safetensors")
    loaded = safetensors.torch.load_file(files[0])
    assert sorted(loaded) == ["body.bias", "body.weight", "emb.weight"]  # head.weight: the tie
    torch.manual_seed(1)
    fresh = TiedLM()
    assert ftrain.checkpoint.load_weights(fresh, files[0], strict=True) == ([], [])
    assert fresh.head.weight is fresh.emb.weight  # still tied
    assert_same(fresh.state_dict(), model.state_dict())


def test_a_tie_saved_under_its_second_name_loads_strictly_as_torch_does(tmp_path):
    """A file holding the tied tensor under the second name only (head.weight, as other
    exporters may write it): nothing is missing, as torch's strict load_state_dict says."""
    torch.manual_seed(0)
    model = TiedLM()
    weights = {k: v for k, v in model.state_dict().items() if k != "emb.weight"}
    safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()},
                                tmp_path / "second.safetensors")  # fmt: skip
    torch.manual_seed(1)
    fresh = TiedLM()
    torch.manual_seed(1)
    ref = TiedLM()
    ref.load_state_dict(weights, strict=False)  # torch: the tie fills emb.weight
    got = ftrain.checkpoint.load_weights(fresh, tmp_path / "second.safetensors", strict=True)
    assert got == ([], [])
    assert fresh.head.weight is fresh.emb.weight
    assert_same(fresh.state_dict(), ref.state_dict())
    assert_same(fresh.state_dict(), model.state_dict())


def test_the_average_of_a_tied_model_is_written_under_its_first_name(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    state = ftrain.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.5))
    step = ftrain.with_ema(ftrain.make_step(lambda m, x: m(x).pow(2).mean()), decay=0.5)
    for _ in range(3):
        state, _ = step(state, torch.arange(10).reshape(2, 5))
    path = ftrain.checkpoint.export_weights(state, tmp_path / "ema.safetensors", ema=True)[0]
    loaded = safetensors.torch.load_file(path)
    assert_same(loaded, ema_state_dict(state))  # the average holds the tie once
    assert sorted(loaded) == ["body.bias", "body.weight", "emb.weight"]
    assert not torch.equal(loaded["emb.weight"], model.emb.weight)
    fresh = TiedLM()
    assert ftrain.checkpoint.load_weights(fresh, path, strict=True) == ([], [])
    assert torch.equal(fresh.head.weight, loaded["emb.weight"])


def test_views_of_one_storage_are_copied_not_refused(tmp_path):
    base = torch.arange(12.0)
    weights = {"all": base, "first": base[:4], "strided": base[::2], "alias": base}
    path = ftrain.checkpoint.export_weights(weights, tmp_path / "v.safetensors")[0]
    loaded = safetensors.torch.load_file(path)
    assert sorted(loaded) == ["all", "first", "strided"]
    for k in loaded:
        assert torch.equal(loaded[k], weights[k]), k


# ------------------------------------------------------------------ EMA and checkpoints
def test_ema_export_is_the_average_under_the_model_names(tmp_path):
    state = trained(ema=True)
    ftrain.checkpoint.export_weights(state, tmp_path / "ema.safetensors", ema=True)
    loaded = safetensors.torch.load_file(tmp_path / "ema.safetensors")
    assert_same(loaded, ema_state_dict(state))
    assert not torch.equal(loaded["fc1.weight"], state.model.fc1.weight)  # not the weights


def test_a_checkpoint_exports_as_the_live_state_does(tmp_path):
    model = make_model(0)
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    step = ftrain.with_ema(ftrain.make_step(mse_loss), decay=0.5)
    hooks = [ftrain.CheckpointHook(3, background=False)]
    state = ftrain.Loop(
        step, state, make_batches(3), hooks, epochs=1, work_dir=tmp_path / "run"
    ).run()
    for ema in (False, True):
        live = ftrain.checkpoint.export_weights(state, tmp_path / f"live{ema}.safetensors", ema=ema)
        saved = ftrain.checkpoint.export_weights(
            tmp_path / "run" / "iter_3.pth", tmp_path / f"file{ema}.safetensors", ema=ema
        )
        assert filecmp.cmp(live[0], saved[0], shallow=False), ema
    plain = tmp_path / "plain.pth"  # a bare state dict file
    torch.save(state.model.state_dict(), plain)
    ftrain.checkpoint.export_weights(plain, tmp_path / "plain.safetensors")
    assert filecmp.cmp(
        tmp_path / "plain.safetensors", tmp_path / "liveFalse.safetensors", shallow=False
    )


# ------------------------------------------------------------------ transformers
def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def test_gpt2_export_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_gpt2()
    state = ftrain.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    step = ftrain.make_step(lm_loss)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # trained weights, not the initialisation from_pretrained could redo
        state, _ = step(state, torch.randint(0, 97, (4, 16), generator=g))
    files = ftrain.checkpoint.export_weights(state, tmp_path / "ours")
    assert [f.name for f in files] == ["model.safetensors", "config.json"]
    state.model.save_pretrained(tmp_path / "hf")  # transformers' own export: the same tensors
    assert_same(safetensors.torch.load_file(files[0]),
                safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors"))  # fmt: skip
    ids = torch.randint(0, 97, (2, 12), generator=g)
    with torch.no_grad():
        expected = state.model.eval()(ids).logits
        for path, shard_size in ((tmp_path / "ours", None), (tmp_path / "sharded", "20KB")):
            if shard_size:
                ftrain.checkpoint.export_weights(state, path, max_shard_size=shard_size)
                assert len(list(path.glob("model-*-of-*.safetensors"))) > 2
            loaded = AutoModelForCausalLM.from_pretrained(path).eval()
            diff = float((loaded(ids).logits - expected).abs().max())
            print(f"from_pretrained({path.name}) logits max |diff| = {diff}")
            assert diff == 0.0
            assert loaded.lm_head.weight is loaded.transformer.wte.weight
        fresh = tiny_gpt2(seed=5)
        assert ftrain.checkpoint.load_weights(fresh, tmp_path / "sharded", strict=True) == ([], [])
        assert torch.equal(fresh.eval()(ids).logits, expected)


def test_llama_with_a_given_config_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                         max_position_embeddings=32, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    weights = {k: v.clone() for k, v in model.state_dict().items()}  # a bare state dict
    ftrain.checkpoint.export_weights(weights, tmp_path / "llama", config=config)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "llama").eval()
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        diff = float((loaded(ids).logits - model(ids).logits).abs().max())
    print(f"llama from_pretrained logits max |diff| = {diff}")
    assert diff == 0.0 and type(loaded) is LlamaForCausalLM


# ------------------------------------------------------------------ load_weights errors
def test_load_weights_names_missing_and_unexpected_keys_and_loads_nothing(tmp_path):
    path = ftrain.checkpoint.export_weights(make_model(0), tmp_path / "w.safetensors")[0]
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(
        CheckpointError,
        match=r"missing \['0.weight', '0.bias', '2.weight', "
        r"'2.bias'\].*unexpected \['fc1.bias', 'fc1.weight'.*Nothing was loaded.*prefix=",
    ):
        ftrain.checkpoint.load_weights(other, path, strict=True)
    assert_same(other.state_dict(), before)
    missing, unexpected = ftrain.checkpoint.load_weights(other, path)
    assert missing == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert unexpected == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]  # the file's order
    with pytest.raises(CheckpointError, match=r"fc1.weight: saved \(16, 8\), model \(16, 9\)"):
        ftrain.checkpoint.load_weights(make_model(0, d_in=9), path)


def test_load_weights_strips_a_prefix_from_a_hugging_face_directory(tmp_path):
    model = make_model(0)
    wrapped = torch.nn.ModuleDict({"backbone": model})
    ftrain.checkpoint.export_weights(wrapped, tmp_path / "out")
    fresh = make_model(3)
    assert ftrain.checkpoint.load_weights(fresh, tmp_path / "out", prefix="backbone.") == ([], [])
    assert_same(fresh.state_dict(), model.state_dict())


def test_a_broken_directory_is_a_clear_error(tmp_path):
    out = tmp_path / "out"
    ftrain.checkpoint.export_weights(make_model(0), out, max_shard_size=400)
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lists shard\(s\) \['model-00002-of-00002"):
        ftrain.checkpoint.load_weights(make_model(0), out)
    (out / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a readable index"):
        ftrain.checkpoint.load_weights(make_model(0), out)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 20)
    with pytest.raises(CheckpointError, match="cannot be read as a safetensors file"):
        ftrain.checkpoint.load_weights(make_model(0), bad)


# ------------------------------------------------------------------ bad arguments
def test_bad_export_arguments_are_clear_errors(tmp_path):
    state = trained()
    with pytest.raises(ValueError, match="config goes into a directory"):
        ftrain.checkpoint.export_weights(state, tmp_path / "w.safetensors", config={"a": 1})
    with pytest.raises(ValueError, match="no weight average.*with_ema"):
        ftrain.checkpoint.export_weights(state, tmp_path / "e", ema=True)
    with pytest.raises(ValueError, match="pass the state, not the model"):
        ftrain.checkpoint.export_weights(state.model, tmp_path / "e", ema=True)
    with pytest.raises(ValueError, match="max_shard_size"):
        ftrain.checkpoint.export_weights(state, tmp_path / "e", max_shard_size="big")
    with pytest.raises(TypeError, match="config must be a transformers config or a dict"):
        ftrain.checkpoint.export_weights(state, tmp_path / "e", config=3)
    with pytest.raises(TypeError, match="source must be"):
        ftrain.checkpoint.export_weights(3, tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_without_safetensors_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"pip install 'ftrain\[export\]'"):
        ftrain.checkpoint.export_weights(make_model(0), tmp_path / "w.safetensors")


def test_doctests():
    for name in (
        "ftrain.persist.export",
        "ftrain.persist.safetensors_files",
        "ftrain.persist.weights",
    ):
        module = importlib.import_module(name)
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0, name


def test_docs_page_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/export.md python block {i + 1}", "exec"), namespace)  # noqa: S102


# ------------------------------------------------------------------ DDP and FSDP2
@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_distributed_export_equals_the_one_process_export(tmp_path, strategy):
    launch_worker("export", tmp_path, strategy)
    ranks = [result(tmp_path, f"export_{strategy}", r) for r in (0, 1)]
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
              "model.safetensors.index.json"]  # fmt: skip
    assert ranks[0]["written"]["dir"] == shards and ranks[1]["written"]["dir"] == []
    assert all(r["exists"] and r["seen_after_return"] == shards for r in ranks)
    checkpoint = (
        tmp_path / f"run_{strategy}" / ("iter_3.dcp" if strategy == "fsdp2" else "iter_3.pth")
    )
    # the same weights, exported here in one process from the checkpoint the run wrote
    one = tmp_path / "one"
    ftrain.checkpoint.export_weights(checkpoint, one / "live", max_shard_size=400)
    ftrain.checkpoint.export_weights(checkpoint, one / "one.safetensors")
    ftrain.checkpoint.export_weights(checkpoint, one / "ema", ema=True)
    for mine, theirs in (("live", f"{strategy}_live"), ("ema", f"{strategy}_ema")):
        names = sorted(os.listdir(one / mine))
        assert names == sorted(os.listdir(tmp_path / theirs))
        for n in names:
            assert filecmp.cmp(one / mine / n, tmp_path / theirs / n, shallow=False), (mine, n)
    assert filecmp.cmp(
        one / "one.safetensors", tmp_path / f"{strategy}_one.safetensors", shallow=False
    )
    params = torch.load(tmp_path / f"{strategy}_params.pt", weights_only=True)  # gathered live
    assert_same(safetensors.torch.load_file(one / "one.safetensors"), params)
    ema = safetensors.torch.load_file(one / "ema" / "model.safetensors")
    assert ema.keys() == params.keys() and not torch.equal(ema["fc1.weight"], params["fc1.weight"])


def launch_worker(scenario: str, out: Path, *args: str, nproc: int = 2) -> None:
    """Run an ``export_worker.py`` scenario under torchrun (gloo, CPU); fail with its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(WORKER), scenario, str(out), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {scenario} {args} failed ({proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")  # fmt: skip


def result(out: Path, name: str, rank: int = 0) -> dict:
    return json.loads((out / f"{name}_rank{rank}.json").read_text())
