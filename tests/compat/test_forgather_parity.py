"""Parity with Forgather's ``forgather.ml.sharded_checkpoint``: the cases of its unit tests
(jdinalt/forgather ``tests/unit/ml/test_sharded_checkpoint.py``), written for ckptd, plus a
model directory laid out the way Forgather's trainer writes it (its own
``checkpoint_manifest.json``, ``pytorch_model.bin``, ``eval_metrics.json``).

Deliberate differences, tested as ckptd behaves (docs/migration.md says why):
``save_checkpoint(..., safetensors=True)`` of a tied model stores the tie once instead of
raising; ``save_checkpoint`` also writes a ckptd manifest last.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import time
from datetime import datetime

import pytest
import torch
from conftest import assert_same
from safetensors.torch import save_file

import ckptd
from ckptd.compat import forgather as fg
from ckptd.compat.forgather import (
    CHECKPOINT_MANIFEST_FILENAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)


class TwoLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(10, 5)
        self.linear2 = torch.nn.Linear(5, 2)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(100, 32)
        self.lm_head = torch.nn.Linear(32, 100, bias=False)
        self.lm_head.weight = self.embedding.weight


class WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.register_buffer("my_buffer", torch.zeros(4))


def all_names(mapping):
    return set().union(*mapping.values()) if mapping else set()


# ---- names, constants, signatures ----------------------------------------------------------


def test_constants_are_the_hf_file_names():
    assert WEIGHTS_NAME == "pytorch_model.bin"
    assert WEIGHTS_INDEX_NAME == "pytorch_model.bin.index.json"
    assert SAFE_WEIGHTS_NAME == "model.safetensors"
    assert SAFE_WEIGHTS_INDEX_NAME == "model.safetensors.index.json"
    assert CHECKPOINT_MANIFEST_FILENAME == "checkpoint_manifest.json"
    assert fg.MODEL_EXCLUDED_MARKER == ".forgather_no_model_weights"


FORGATHER_SIGNATURES = {
    "save_checkpoint": "output_dir module metadata=None safetensors=False max_shard_size=2147483648 debug=False "
    "include_param_sharing=True param_sharing_metadata=None",
    "save_sharded_checkpoint": "output_dir shard_index module safetensors=False debug=False",
    "save_shard_index": "shard_index output_dir index_name",
    "make_shard_index": "state_dictionaries metadata=None safetensors=False max_shard_size=4294967296 "
    "param_sharing_metadata=None",
    "load_checkpoint": "model_dir module=None device='cpu' strict=True assign=False keys=None",
    "load_sharded_checkpoint": "model_dir shard_index module=None device='cpu' safetensors=False strict=True "
    "assign=False debug=False keys=None",
    "load_shard_index": "output_dir index_name",
    "find_latest_checkpoint": "model_dir",
    "next_checkpoint_path": "model_dir checkpoint_id",
    "validate_checkpoint": "checkpoint_path",
    "get_checkpoint_metadata": "path",
    "maybe_delete_oldest_checkpoint": "model_dir max_checkpoints best_checkpoint=None preserved_checkpoints=None",
    "save_checkpoint_metrics": "checkpoint_path metrics",
    "load_checkpoint_metrics": "checkpoint_path",
    "create_pretrained_symlinks": "model_dir force_overwrite=False dry_run=False",
    "validate_output_dir": "output_dir overwrite=False",
    "id_to_fqn": "module",
    "get_all_fqns": "module",
    "make_cannonical_names": "fqns sharing_metadata",
    "map_cannonical_names": "cnames",
    "create_sharing_metadata": "model",
    "retie_parameters": "module sharing_metadata",
    "index_file_name": "safetensors",
}


@pytest.mark.parametrize("name", sorted(FORGATHER_SIGNATURES))
def test_positional_parameters_match_forgather(name):
    fn = getattr(fg, name)
    params = [p for p in inspect.signature(fn).parameters.values() if p.kind != p.KEYWORD_ONLY]
    spelled = " ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params)
    assert spelled == FORGATHER_SIGNATURES[name]
    assert name in fg.__all__
    assert getattr(ckptd, name) is fn, "importable from the top level too"


# ---- tied-parameter helpers ----------------------------------------------------------------


def test_id_to_fqn():
    names = all_names(id_to_fqn := fg.id_to_fqn(TwoLinear()))
    assert {"linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"} <= names
    assert len(id_to_fqn) == 4
    tied = fg.id_to_fqn(Tied())
    assert any({"embedding.weight", "lm_head.weight"} <= group for group in tied.values())
    assert {"my_buffer", "linear.weight", "linear.bias"} <= all_names(fg.id_to_fqn(WithBuffer()))


def test_get_all_fqns():
    assert fg.get_all_fqns(TwoLinear()) == {"linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"}
    assert fg.get_all_fqns(WithBuffer()) == {"linear.weight", "linear.bias", "my_buffer"}
    assert {"embedding.weight", "lm_head.weight"} <= fg.get_all_fqns(Tied())
    assert fg.get_all_fqns(torch.nn.Module()) == set()


def test_make_and_map_cannonical_names():
    cnames = fg.make_cannonical_names(
        {"embedding.weight", "lm_head.weight", "x"}, [["embedding.weight", "lm_head.weight"]]
    )
    assert len(cnames) == 1
    ((canonical, aliases),) = cnames.items()
    assert {canonical, *aliases} == {"embedding.weight", "lm_head.weight"}
    assert fg.make_cannonical_names({"a", "b"}, [["embedding.weight", "lm_head.weight"]]) == {}
    assert fg.make_cannonical_names({"embedding.weight", "x"}, [["embedding.weight", "lm_head.weight"]]) == {
        "embedding.weight": []
    }
    assert fg.make_cannonical_names({"a"}, []) == {}
    assert len(fg.make_cannonical_names({"a", "b", "c", "d"}, [["a", "b"], ["c", "d"]])) == 2

    assert fg.map_cannonical_names({"embedding.weight": ["lm_head.weight"]}) == {"lm_head.weight": "embedding.weight"}
    assert fg.map_cannonical_names({"a": ["b", "c"], "x": ["y"]}) == {"b": "a", "c": "a", "y": "x"}
    assert fg.map_cannonical_names({"a": []}) == {}
    assert fg.map_cannonical_names({}) == {}


def test_create_sharing_metadata():
    assert fg.create_sharing_metadata(TwoLinear()) == []
    assert fg.create_sharing_metadata(WithBuffer()) == []
    (group,) = fg.create_sharing_metadata(Tied())
    assert set(group) == {"embedding.weight", "lm_head.weight"}


# ---- index -----------------------------------------------------------------------------------


def test_make_shard_index_cases():
    index = fg.make_shard_index([{"layer1.weight": torch.randn(10, 5), "layer1.bias": torch.randn(10)}])
    assert set(index) == {"metadata", "weight_map"} and "total_size" in index["metadata"]
    (only,) = set(index["weight_map"].values())
    assert only.startswith("pytorch_model-") and set(index["weight_map"]) == {"layer1.weight", "layer1.bias"}
    assert next(
        iter(fg.make_shard_index([{"w": torch.randn(2, 2)}], safetensors=True)["weight_map"].values())
    ).endswith(".safetensors")
    two = fg.make_shard_index([{"a": torch.randn(5, 5)}, {"b": torch.randn(5, 5)}])["weight_map"]
    assert two["a"] != two["b"]
    split = fg.make_shard_index([{"big": torch.randn(100, 100), "small": torch.randn(2, 2)}], max_shard_size=1)
    assert len(set(split["weight_map"].values())) == 2
    meta = fg.make_shard_index([{"w": torch.randn(2)}], metadata={"dtype": "bfloat16", "custom_key": "v"})["metadata"]
    assert meta["dtype"] == "bfloat16" and meta["custom_key"] == "v" and "total_size" in meta
    sharing = [["embedding.weight", "lm_head.weight"]]
    assert (
        fg.make_shard_index([{"w": torch.randn(2)}], param_sharing_metadata=sharing)["metadata"]["param_sharing"]
        == sharing
    )
    assert "param_sharing" not in fg.make_shard_index([{"w": torch.randn(2)}])["metadata"]
    empty = fg.make_shard_index([{}])
    assert empty["weight_map"] == {} and empty["metadata"]["total_size"] == 0
    files = sorted(
        set(
            fg.make_shard_index([{"a": torch.randn(2)}, {"b": torch.randn(2)}, {"c": torch.randn(2)}])[
                "weight_map"
            ].values()
        )
    )
    assert [f.split("-", 1)[1] for f in files] == [f"0000{i}-of-00003.bin" for i in (1, 2, 3)]


def test_private_helpers_behave_like_forgathers():
    t1, t2, t3 = torch.randn(3), torch.randn(4), torch.randn(5)
    weight_map = {"l1": "s1.bin", "l2": "s1.bin", "l3": "s2.bin"}
    assert fg._intersect_weight_map(weight_map, {"l1": t1, "l2": t2, "other": t3}) == {"l1", "l2"}
    assert fg._intersect_weight_map({}, {}) == set()
    grouped = fg._make_shard_dictionaries(weight_map, {"l1": t1, "l2": t2, "l3": t3})
    assert set(grouped) == {"s1.bin", "s2.bin"} and grouped["s1.bin"]["l1"] is t1 and grouped["s2.bin"]["l3"] is t3
    assert fg._make_shard_dictionaries({"a": "s1.bin"}, {}) == {}
    d = {"w": torch.randn(3)}
    assert fg._resolve_state_dict(d) is d
    assert "linear1.weight" in fg._resolve_state_dict(TwoLinear())


# ---- metadata, paths, metrics ----------------------------------------------------------------


def write_json(path, body):
    with open(path, "w") as f:
        json.dump(body, f)


def test_get_checkpoint_metadata_detects_and_prefers(tmp_path):
    d = str(tmp_path)
    assert fg.get_checkpoint_metadata(d) is None
    torch.save({"w": torch.randn(2)}, os.path.join(d, WEIGHTS_NAME))
    assert fg.get_checkpoint_metadata(d) == fg.CheckpointMeta(WEIGHTS_NAME, False, False)
    write_json(os.path.join(d, WEIGHTS_INDEX_NAME), {"metadata": {}, "weight_map": {}})
    assert fg.get_checkpoint_metadata(d) == fg.CheckpointMeta(WEIGHTS_INDEX_NAME, True, False)
    write_json(os.path.join(d, SAFE_WEIGHTS_INDEX_NAME), {"metadata": {}, "weight_map": {}})
    assert fg.get_checkpoint_metadata(d) == fg.CheckpointMeta(SAFE_WEIGHTS_INDEX_NAME, True, True)
    single = tmp_path / "single"
    single.mkdir()
    save_file({"w": torch.randn(2)}, str(single / SAFE_WEIGHTS_NAME))
    assert fg.get_checkpoint_metadata(str(single)) == fg.CheckpointMeta(SAFE_WEIGHTS_NAME, False, True)


def test_next_checkpoint_path_is_unpadded():
    assert fg.next_checkpoint_path("/models/m", 1000) == "/models/m/checkpoints/checkpoint-1000"
    assert fg.next_checkpoint_path("/models/m", "step_500") == "/models/m/checkpoints/checkpoint-step_500"
    assert fg.next_checkpoint_path("/models/m", 0) == "/models/m/checkpoints/checkpoint-0"


def test_checkpoint_metrics(tmp_path):
    d = str(tmp_path)
    assert fg.load_checkpoint_metrics(d) is None
    fg.save_checkpoint_metrics(d, {"loss": 0.5, "accuracy": 0.95})
    assert fg.load_checkpoint_metrics(d) == {"loss": 0.5, "accuracy": 0.95}
    text = (tmp_path / "eval_metrics.json").read_text()
    assert "\n" in text and json.loads(text) == {"loss": 0.5, "accuracy": 0.95}, "indented JSON"
    fg.save_checkpoint_metrics(d, {"loss": 0.25})
    assert fg.load_checkpoint_metrics(d) == {"loss": 0.25}
    fg.save_checkpoint_metrics(d, {})
    assert fg.load_checkpoint_metrics(d) == {}
    new_dir = tmp_path / "not" / "yet"
    fg.save_checkpoint_metrics(str(new_dir), {"loss": 1.0})
    assert (new_dir / "eval_metrics.json").is_file()


# ---- rotation and timestamps -----------------------------------------------------------------


class ModelDir:
    """``<tmp>/checkpoints/checkpoint-<n>`` directories made a little apart in time."""

    def __init__(self, root) -> None:
        self.root = str(root)
        self.checkpoints = os.path.join(self.root, "checkpoints")
        os.makedirs(self.checkpoints)

    def make(self, step, timestamp=None, delay=0.02):
        time.sleep(delay)
        path = os.path.join(self.checkpoints, f"checkpoint-{step}")
        os.makedirs(path)
        with open(os.path.join(path, "data.txt"), "w") as f:
            f.write(str(step))
        if timestamp is not None:
            write_json(os.path.join(path, CHECKPOINT_MANIFEST_FILENAME), {"timestamp": timestamp.isoformat()})
        return path

    def left(self):
        return sorted(int(n.split("-")[1]) for n in os.listdir(self.checkpoints))


@pytest.mark.parametrize(
    ("count", "max_checkpoints", "preserve", "left"),
    [
        (2, 3, [], [100, 200]),
        (3, 3, [], [100, 200, 300]),
        (4, 3, [], [200, 300, 400]),
        (4, 3, [0], [100, 300, 400]),
        (5, 3, [0, 1], [100, 200, 500]),
        (5, 2, [], [400, 500]),
    ],
)
def test_maybe_delete_oldest_checkpoint(tmp_path, count, max_checkpoints, preserve, left):
    model = ModelDir(tmp_path)
    paths = [model.make(100 * (i + 1)) for i in range(count)]
    fg.maybe_delete_oldest_checkpoint(model.root, max_checkpoints, preserved_checkpoints=[paths[i] for i in preserve])
    assert model.left() == left


def test_best_and_preserved_count_against_the_limit(tmp_path):
    model = ModelDir(tmp_path)
    paths = [model.make(s) for s in (100, 200, 300, 400)]
    fg.maybe_delete_oldest_checkpoint(model.root, 2, best_checkpoint=paths[0], preserved_checkpoints=[paths[1]])
    assert model.left() == [100, 200]


def test_rotation_without_a_checkpoints_folder_does_nothing(tmp_path):
    (tmp_path / "checkpoint-1").mkdir()
    fg.maybe_delete_oldest_checkpoint(str(tmp_path), 0)
    assert (tmp_path / "checkpoint-1").is_dir()


def test_rotation_orders_by_manifest_timestamp(tmp_path):
    model = ModelDir(tmp_path)
    model.make(100, datetime(2026, 1, 1, 10))
    model.make(200, datetime(2026, 1, 1, 12))
    model.make(300, datetime(2026, 1, 1, 11))
    model.make(400, datetime(2026, 1, 1, 13))
    fg.maybe_delete_oldest_checkpoint(model.root, 3)
    assert model.left() == [200, 300, 400]
    fg.maybe_delete_oldest_checkpoint(model.root, 2)
    assert model.left() == [200, 400], "300's manifest time is older than 200's"


def test_rotation_mixes_manifest_and_legacy_checkpoints(tmp_path):
    model = ModelDir(tmp_path)
    model.make(100, datetime(2020, 1, 1))
    model.make(200)
    model.make(300, datetime(2099, 1, 1))
    model.make(400)
    fg.maybe_delete_oldest_checkpoint(model.root, 3)
    assert model.left() == [200, 300, 400]


def test_checkpoint_timestamp(tmp_path):
    path = tmp_path / "checkpoint-100"
    path.mkdir()
    mtime = os.path.getmtime(path)
    assert fg._get_checkpoint_timestamp(str(path)) == mtime
    for bad in ("not valid json{{{",):
        (path / CHECKPOINT_MANIFEST_FILENAME).write_text(bad)
        assert fg._get_checkpoint_timestamp(str(path)) == os.path.getmtime(path)
    for body in ({"world_size": 4}, {"timestamp": "not-a-date"}):
        write_json(path / CHECKPOINT_MANIFEST_FILENAME, body)
        assert fg._get_checkpoint_timestamp(str(path)) == os.path.getmtime(path)
    stamp = datetime(2026, 3, 15, 14, 30)
    write_json(path / CHECKPOINT_MANIFEST_FILENAME, {"timestamp": stamp.isoformat()})
    assert fg._get_checkpoint_timestamp(str(path)) == stamp.timestamp()
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    assert fg._get_checkpoint_timestamp(str(copy)) == stamp.timestamp(), "stable across copies"


# ---- save and load, dict and module modes ----------------------------------------------------


def four_tensors():
    return {
        "layer1.weight": torch.randn(4, 3),
        "layer1.bias": torch.randn(4),
        "layer2.weight": torch.randn(2, 4),
        "layer2.bias": torch.randn(2),
    }


@pytest.mark.parametrize("safetensors", [False, True])
def test_save_dict_load_dict(tmp_path, safetensors):
    original = four_tensors()
    fg.save_checkpoint(str(tmp_path), original, safetensors=safetensors)
    assert_same(original, fg.load_checkpoint(str(tmp_path), module=None, device="cpu"))
    subset = fg.load_checkpoint(str(tmp_path), None, "cpu", keys={"layer1.weight", "layer1.bias"})
    assert_same({k: original[k] for k in ("layer1.weight", "layer1.bias")}, subset)


def test_save_dict_load_module_and_back(tmp_path):
    model = TwoLinear()
    fg.save_checkpoint(str(tmp_path / "a"), model.state_dict())
    fresh = TwoLinear()
    fg.load_checkpoint(str(tmp_path / "a"), fresh, device="cpu")
    assert_same(model.state_dict(), fresh.state_dict())
    fg.save_checkpoint(str(tmp_path / "b"), model)
    assert_same(model.state_dict(), fg.load_checkpoint(str(tmp_path / "b"), module=None))


def test_explicit_sharing_of_distinct_tensors_keeps_both(tmp_path):
    sd = {"embed.weight": torch.randn(10, 4), "head.weight": torch.randn(10, 4)}
    fg.save_checkpoint(str(tmp_path), sd, safetensors=False, param_sharing_metadata=[["embed.weight", "head.weight"]])
    assert_same(sd, fg.load_checkpoint(str(tmp_path), module=None))


@pytest.mark.parametrize("safetensors", [False, True])
def test_save_sharded_and_load_sharded(tmp_path, safetensors):
    original = {"x": torch.randn(3, 2), "y": torch.randn(4), "z": torch.randn(5)}
    index = fg.make_shard_index([original], safetensors=safetensors)
    fg.save_shard_index(index, str(tmp_path), fg.index_file_name(safetensors))
    fg.save_sharded_checkpoint(str(tmp_path), index, original, safetensors)
    for name in set(index["weight_map"].values()):
        assert (tmp_path / name).is_file()
    assert fg.load_shard_index(str(tmp_path), fg.index_file_name(safetensors)) == index
    loaded = fg.load_sharded_checkpoint(str(tmp_path), index, None, "cpu", safetensors)
    assert_same(original, loaded)
    some = fg.load_sharded_checkpoint(str(tmp_path), index, None, "cpu", safetensors, keys={"x", "z"})
    assert_same({"x": original["x"], "z": original["z"]}, some)


def test_load_sharded_into_module_returns_unloaded_keys(tmp_path):
    model = TwoLinear()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    index = fg.make_shard_index([state])
    fg.save_shard_index(index, str(tmp_path), WEIGHTS_INDEX_NAME)
    fg.save_sharded_checkpoint(str(tmp_path), index, state)
    fresh = TwoLinear()
    assert fg.load_sharded_checkpoint(str(tmp_path), index, fresh, device="cpu") == set()
    assert_same(state, fresh.state_dict())


@pytest.mark.parametrize("file_name", [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])
def test_single_file_checkpoints(tmp_path, file_name):
    original = {"w": torch.randn(3, 2), "b": torch.randn(3)}
    path = str(tmp_path / file_name)
    torch.save(original, path) if file_name == WEIGHTS_NAME else save_file(original, path)
    assert_same(original, fg.load_checkpoint(str(tmp_path), module=None))
    assert_same({"w": original["w"]}, fg.load_checkpoint(str(tmp_path), module=None, keys={"w"}))


# ---- tied weights --------------------------------------------------------------------------


def test_pytorch_round_trip_keeps_ties(tmp_path):
    model = Tied()
    fg.save_checkpoint(str(tmp_path), model, safetensors=False)
    fresh = Tied()
    fg.load_checkpoint(str(tmp_path), fresh, device="cpu")
    assert fresh.lm_head.weight is fresh.embedding.weight
    assert_same(model.embedding.weight.detach(), fresh.embedding.weight.detach())


def test_safetensors_save_of_a_tied_model_stores_the_tie_once(tmp_path):
    """Forgather raises here (safetensors cannot hold shared storage); ckptd stores it once."""
    model = Tied()
    fg.save_checkpoint(str(tmp_path), model, safetensors=True)
    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == ["embedding.weight"]
    fresh = Tied()
    fg.load_checkpoint(str(tmp_path), fresh)
    assert fresh.lm_head.weight is fresh.embedding.weight
    assert_same(model.embedding.weight.detach(), fresh.lm_head.weight.detach())


def hf_deduped(tmp_path, sharded: bool) -> Tied:
    """An HF-style checkpoint of a tied model: ``lm_head.weight`` left out, no sharing metadata."""
    source = Tied()
    with torch.no_grad():
        source.embedding.weight.normal_()
    deduped = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    if sharded:
        index = fg.make_shard_index([deduped], safetensors=True)
        write_json(tmp_path / SAFE_WEIGHTS_INDEX_NAME, index)
        save_file(deduped, str(tmp_path / next(iter(index["weight_map"].values()))))
    else:
        save_file(deduped, str(tmp_path / SAFE_WEIGHTS_NAME))
    return source


@pytest.mark.parametrize("sharded", [False, True])
def test_deduplicated_tie_loads_strictly(tmp_path, sharded):
    source = hf_deduped(tmp_path, sharded)
    target = Tied()
    assert not torch.equal(target.embedding.weight, source.embedding.weight)
    fg.load_checkpoint(str(tmp_path), target, device="cpu", strict=True)
    assert_same(source.embedding.weight.detach(), target.embedding.weight.detach())
    assert target.lm_head.weight is target.embedding.weight


@pytest.mark.parametrize("sharded", [False, True])
def test_assign_fills_the_untied_alias(tmp_path, sharded):
    """The silent-wrong-weights bug: with ``assign=True`` the alias kept its random init."""
    source = hf_deduped(tmp_path, sharded)
    target = Tied()
    fg.load_checkpoint(str(tmp_path), target, device="cpu", strict=True, assign=True)
    expected = source.embedding.weight.detach()
    assert_same(expected, target.embedding.weight.detach())
    assert_same(expected, target.lm_head.weight.detach())
    assert target.lm_head.weight.data_ptr() == target.embedding.weight.data_ptr(), "one storage, as in Forgather"
    target.lm_head.weight = target.embedding.weight  # what tie_weights() does afterwards
    assert target.lm_head.weight is target.embedding.weight


@pytest.mark.parametrize("sharded", [False, True])
def test_genuinely_missing_key_still_fails(tmp_path, sharded):
    sd = {"linear1.weight": torch.randn(5, 10)}
    if sharded:
        index = fg.make_shard_index([sd], safetensors=True)
        write_json(tmp_path / SAFE_WEIGHTS_INDEX_NAME, index)
        save_file(sd, str(tmp_path / next(iter(index["weight_map"].values()))))
    else:
        save_file(sd, str(tmp_path / SAFE_WEIGHTS_NAME))
    with pytest.raises(KeyError, match=r"linear1\.bias"):
        fg.load_checkpoint(str(tmp_path), TwoLinear(), device="cpu", strict=True)


# ---- a model directory written by Forgather's trainer ----------------------------------------


def forgather_checkpoint(path: str, model: torch.nn.Module, stamp: datetime, loss: float) -> None:
    """What Forgather's CheckpointManager leaves: weights, training state files, its manifest
    (its own schema under ckptd's file name) and eval metrics."""
    os.makedirs(path)
    torch.save(model.state_dict(), os.path.join(path, WEIGHTS_NAME))
    torch.save({"global_step": 1}, os.path.join(path, "trainer_state.pt"))
    torch.save({"state": {}, "param_groups": []}, os.path.join(path, "optimizer_state.pt"))
    manifest = {
        "checkpoint_path": path,
        "world_size": 1,
        "timestamp": stamp.isoformat(),
        "components": {
            "trainer": {
                "key": "trainer",
                "sharing_pattern": "global",
                "ranks": [0],
                "replicated_across": None,
                "group_name": None,
                "size_bytes": 1024,
                "checksum": None,
                "metadata": {},
            }
        },
        "training_args_hash": None,
        "forgather_version": "0.1.0",
        "pytorch_version": torch.__version__,
        "metadata": {},
    }
    write_json(os.path.join(path, CHECKPOINT_MANIFEST_FILENAME), manifest)
    write_json(os.path.join(path, "eval_metrics.json"), {"eval_loss": loss})


@pytest.fixture
def forgather_model_dir(tmp_path):
    """Three Forgather checkpoints; step 300 was written *before* step 200 (by its manifest)."""
    models = {}
    for step, hour in ((100, 1), (300, 2), (200, 3)):
        torch.manual_seed(step)
        models[step] = TwoLinear()
        path = fg.next_checkpoint_path(str(tmp_path), step)
        forgather_checkpoint(path, models[step], datetime(2026, 1, 1, hour), loss=1.0 / step)
    return str(tmp_path), models


def test_forgather_directory_is_found_validated_and_loaded(forgather_model_dir):
    model_dir, models = forgather_model_dir
    latest = fg.find_latest_checkpoint(model_dir)
    assert latest == os.path.join(model_dir, "checkpoints", "checkpoint-200"), "latest by manifest time"
    assert fg.validate_checkpoint(latest)
    assert fg.load_checkpoint_metrics(latest) == {"eval_loss": 1.0 / 200}
    fresh = TwoLinear()
    fg.load_checkpoint(latest, fresh, strict=True)
    assert_same(models[200].state_dict(), fresh.state_dict())
    assert_same(models[200].state_dict(), ckptd.CheckpointReader.open(latest).read("model"))
    assert fg.get_checkpoint_metadata(latest) == fg.CheckpointMeta(WEIGHTS_NAME, False, False)


def test_forgather_directory_is_rotated(forgather_model_dir):
    model_dir, _ = forgather_model_dir
    best = fg.next_checkpoint_path(model_dir, 100)
    fg.maybe_delete_oldest_checkpoint(model_dir, 2, best_checkpoint=best)
    assert sorted(os.listdir(os.path.join(model_dir, "checkpoints"))) == ["checkpoint-100", "checkpoint-200"]


def test_foreign_manifest_is_not_called_corrupt_but_a_broken_ckptd_one_is(tmp_path, forgather_model_dir):
    model_dir, _ = forgather_model_dir
    path = fg.next_checkpoint_path(model_dir, 100)
    assert ckptd.CheckpointReader.open(path).kind == "torch_bin"
    mine = str(tmp_path / "mine")
    fg.save_checkpoint(mine, {"w": torch.ones(2)}, safetensors=True)
    assert ckptd.CheckpointReader.open(mine).kind == "ckptd"
    body = json.loads((tmp_path / "mine" / CHECKPOINT_MANIFEST_FILENAME).read_text())
    body["files"] = "broken"
    write_json(tmp_path / "mine" / CHECKPOINT_MANIFEST_FILENAME, body)
    with pytest.raises(ckptd.errors.CorruptCheckpointError, match=r"malformed manifest|checksum mismatch"):
        ckptd.CheckpointReader.open(mine)
    assert not fg.validate_checkpoint(path + "-missing")


def test_model_less_forgather_checkpoint_is_valid_only_with_its_marker(tmp_path):
    path = tmp_path / "checkpoint-5"
    path.mkdir()
    write_json(path / CHECKPOINT_MANIFEST_FILENAME, {"timestamp": "2026-01-01T00:00:00", "components": {}})
    assert not fg.validate_checkpoint(str(path))
    (path / fg.MODEL_EXCLUDED_MARKER).write_text("weights live elsewhere\n")
    assert fg.validate_checkpoint(str(path))


def test_weights_directly_in_the_model_dir(tmp_path):
    model = TwoLinear()
    torch.save(model.state_dict(), tmp_path / WEIGHTS_NAME)
    assert fg.find_latest_checkpoint(str(tmp_path)) == str(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert fg.find_latest_checkpoint(str(tmp_path)) is None, "with a checkpoints folder, only it counts"


def test_find_latest_ignores_invalid_checkpoints(tmp_path):
    model = ModelDir(tmp_path)
    assert fg.find_latest_checkpoint(model.root) is None
    model.make("invalid")
    assert fg.find_latest_checkpoint(model.root) is None
    good = model.make(300)
    torch.save({"w": torch.ones(1)}, os.path.join(good, WEIGHTS_NAME))
    model.make(400)  # newer, but no weights
    assert fg.find_latest_checkpoint(model.root) == good


def test_validate_output_dir(tmp_path):
    fg.validate_output_dir(str(tmp_path))
    fg.validate_output_dir(str(tmp_path / "new"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        fg.validate_output_dir(str(tmp_path / "file"))
    fg.save_checkpoint(str(tmp_path / "m"), {"w": torch.ones(1)})
    with pytest.raises(FileExistsError, match="overwrite=True"):
        fg.validate_output_dir(str(tmp_path / "m"))
    fg.validate_output_dir(str(tmp_path / "m"), overwrite=True)


@pytest.mark.parametrize("safetensors", [False, True])
def test_create_pretrained_symlinks(tmp_path, safetensors):
    model_dir = str(tmp_path)
    tensors = {"a": torch.randn(300), "b": torch.randn(300)}
    path = fg.next_checkpoint_path(model_dir, 10)
    fg.save_checkpoint(path, tensors, safetensors=safetensors, max_shard_size=1000)
    index = fg.index_file_name(safetensors)
    expected = {index, *json.loads(open(os.path.join(path, index)).read())["weight_map"].values()}
    assert len(expected) == 3
    in_order = [index, *sorted(expected - {index})]
    assert fg.create_pretrained_symlinks(model_dir, dry_run=True) == [os.path.join(model_dir, n) for n in in_order]
    assert not any(os.path.lexists(os.path.join(model_dir, n)) for n in expected)
    links = fg.create_pretrained_symlinks(model_dir)
    assert {os.path.basename(p) for p in links} == expected
    assert all(os.path.islink(p) and not os.path.isabs(os.readlink(p)) for p in links)
    assert_same(tensors, fg.load_checkpoint(model_dir))
    fg.create_pretrained_symlinks(model_dir)  # replacing links is fine
    os.unlink(links[0])
    open(links[0], "w").close()
    with pytest.raises(FileExistsError, match="force_overwrite"):
        fg.create_pretrained_symlinks(model_dir)
    fg.create_pretrained_symlinks(model_dir, force_overwrite=True)
    assert os.path.islink(links[0])
    with pytest.raises(FileNotFoundError):
        fg.create_pretrained_symlinks(str(tmp_path / "empty"))


def test_checkpointer_load_names_the_foreign_manifest(forgather_model_dir, tmp_path):
    model_dir, _ = forgather_model_dir
    with ckptd.Checkpointer(str(tmp_path / "root")) as ckpt:
        with pytest.raises(ckptd.errors.CheckpointNotFoundError, match="another tool's"):
            ckpt.load(fg.next_checkpoint_path(model_dir, 100))


def test_rotation_deletes_the_checkpoint_an_incremental_save_linked_from(tmp_path):
    model_dir = str(tmp_path)
    frozen = torch.nn.Linear(64, 64).requires_grad_(False)
    with ckptd.Checkpointer(os.path.join(model_dir, "checkpoints"), incremental=True) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"model": frozen, "step": {"n": torch.tensor(step)}})
    fg.maybe_delete_oldest_checkpoint(model_dir, 1)
    assert sorted(os.listdir(os.path.join(model_dir, "checkpoints"))) == ["checkpoint-2"], "2 holds its own files"
    latest = fg.find_latest_checkpoint(model_dir)
    assert latest == fg.next_checkpoint_path(model_dir, 2)
    assert_same(frozen.state_dict(), fg.load_checkpoint(latest))


def test_rotation_keeps_checkpoints_an_older_versions_checkpoint_references(tmp_path, legacy_root, caplog):
    model_dir = str(tmp_path / "model")
    os.makedirs(model_dir)
    os.rename(legacy_root, os.path.join(model_dir, "checkpoints"))  # steps 1-3; 2 and 3 reference 1
    fg.maybe_delete_oldest_checkpoint(model_dir, 1)
    assert sorted(os.listdir(os.path.join(model_dir, "checkpoints"))) == ["checkpoint-1", "checkpoint-3"]
    assert "reference its files" in caplog.text
    loaded = fg.load_checkpoint(os.path.join(model_dir, "checkpoints", "checkpoint-3"))
    assert torch.equal(loaded["adapter.bias"], torch.full((4,), 3.0))


@pytest.mark.parametrize(
    ("body", "foreign"),
    [
        (b'{"timestamp": "2026-01-01T00:00:00", "components": {}}', True),
        (b'{"format": "other-tool", "files": {}}', True),
        (b'{\n "format": "ckptd",\n "format_version": 1}', False),
        (b'{"step": 3, "format": "ckptd"}', False),
        (b'{"format_version": 1}', False),
        (b"not json {{{", False),
        (b"[1, 2]", False),
    ],
)
def test_manifest_schemas_are_told_apart_by_content(body, foreign):
    from ckptd.formats.manifest import is_foreign_manifest

    assert is_foreign_manifest(body) is foreign


def test_a_deeply_nested_manifest_falls_back_to_the_directory_time(tmp_path):
    """A hostile manifest (200k-deep JSON) must not raise RecursionError out of rotation."""
    path = tmp_path / "checkpoint-100"
    path.mkdir()
    (path / CHECKPOINT_MANIFEST_FILENAME).write_text("[" * 200_000 + "]" * 200_000)
    assert fg._get_checkpoint_timestamp(str(path)) == os.path.getmtime(path)
