"""ckptd.compat.modelopt side by side with the real nvidia-modelopt (``pip install ckptd[modelopt]``),
on the same tiny GPT-2 (built from its config, nothing downloaded): same keys and tensors from
``load_sharded_state_dict``, files each writes read by the other and by ``from_pretrained``
(``save_sharded_model`` on real gloo groups of 1 and 2 ranks), the same ``is_in_safetensors_format``
answers, and the same shard layout from ``create_local_shard_``.

Skipped when nvidia-modelopt is not installed.  Manual run: docs/migration.md (ModelOpt).
ModelOpt's ``load_state_dict_to_shards`` and ``load_and_shard_model`` move the model to CUDA, so
they cannot run here; ckptd's versions are tested in test_modelopt.py.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_same
from distributed import run_ranks

import ckptd
from ckptd.compat import modelopt as ours

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # ModelOpt resolves paths with huggingface_hub: never go online
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
real = pytest.importorskip("modelopt.torch.puzzletron.tools.sharded_checkpoint_utils")
descriptor_base = pytest.importorskip("modelopt.torch.puzzletron.anymodel.model_descriptor.base")

pytestmark = [pytest.mark.interop, pytest.mark.hf]


def gpt2(tied: bool = True):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64, tie_word_embeddings=tied
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def stored_state(model) -> dict[str, torch.Tensor]:
    """What an HF checkpoint of ``model`` stores: a tied head is left out."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


@pytest.fixture(scope="module")
def model():
    return gpt2()


@pytest.fixture(scope="module")
def dirs(model, tmp_path_factory) -> dict[str, Path]:
    """The same model in every layout both libraries are asked to read."""
    root = tmp_path_factory.mktemp("layouts")
    made = {name: root / name for name in ("hf_single", "hf_sharded", "hf_bin", "ckptd", "ckptd_modelopt", "empty")}
    model.save_pretrained(made["hf_single"])
    model.save_pretrained(made["hf_sharded"], max_shard_size="40KB")
    made["hf_bin"].mkdir()  # transformers 5 writes only safetensors: the .bin layout HF used to write
    torch.save(stored_state(model), made["hf_bin"] / "pytorch_model.bin")
    ckptd.save_checkpoint(str(made["ckptd"]), model, safetensors=True, max_shard_size="40KB")
    made["ckptd_modelopt"].mkdir()
    ours.save_sharded_model(model, made["ckptd_modelopt"] / "model.safetensors")  # no process group: one shard
    made["empty"].mkdir()
    made["missing"] = root / "missing"
    assert (made["hf_single"] / "model.safetensors").exists()
    assert len(list(made["hf_sharded"].glob("model-*.safetensors"))) > 1
    assert (made["hf_bin"] / "pytorch_model.bin").exists()
    return made


def test_generic_signatures_are_modelopts():
    def spelled(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    for name in (
        "load_sharded_state_dict",
        "save_sharded_model",
        "is_in_safetensors_format",
        "load_state_dict_to_shards",
        "set_submodule",
    ):
        assert spelled(getattr(ours, name)) == spelled(getattr(real, name)), name
    # the descriptor-tied ones: the same parameters, ``owned_keys`` where ModelOpt takes ``descriptor``
    for name in ("create_local_shard_", "create_sharded_model", "load_and_shard_model"):
        theirs = [("owned_keys", d) if n == "descriptor" else (n, d) for n, d in spelled(getattr(real, name))]
        mine = [(n, d) for n, d in spelled(getattr(ours, name)) if n != "dtype" or name != "load_and_shard_model"]
        assert mine == theirs, name


KEY_SETS = {
    "all": None,
    "some": ["transformer.h.1.mlp.c_fc.weight", "transformer.wte.weight", "transformer.ln_f.bias"],
    "model_keys": "model_keys",  # every key of the model, the tied lm_head.weight (not stored) too
    "unknown": ["transformer.h.9.attn.c_attn.weight"],
    "none": [],
}


@pytest.mark.parametrize("keys", list(KEY_SETS))
@pytest.mark.parametrize("layout", ["hf_single", "hf_sharded", "ckptd", "ckptd_modelopt"])
def test_load_sharded_state_dict_same_keys_and_tensors(model, dirs, layout, keys):
    keys_to_load = list(model.state_dict()) if KEY_SETS[keys] == "model_keys" else KEY_SETS[keys]
    theirs = real.load_sharded_state_dict(str(dirs[layout]), keys_to_load=keys_to_load, device="cpu")
    mine = ours.load_sharded_state_dict(str(dirs[layout]), keys_to_load=keys_to_load, device="cpu")
    assert_same(theirs, mine)
    expected = stored_state(model)
    if keys_to_load is not None:
        expected = {k: v for k, v in expected.items() if k in keys_to_load}
    assert_same(expected, mine)
    assert_same(mine, ours.load_sharded_state_dict(dirs[layout], keys_to_load, torch.device("cpu")))  # a Path


def test_single_file_wins_over_an_index(dirs, tmp_path):
    both = tmp_path / "both"
    shutil.copytree(dirs["hf_sharded"], both)
    safetensors_torch.save_file({"only.single": torch.arange(3.0)}, str(both / "model.safetensors"), {"format": "pt"})
    theirs = real.load_sharded_state_dict(str(both))
    assert_same({"only.single": torch.arange(3.0)}, theirs)
    assert_same(theirs, ours.load_sharded_state_dict(str(both)))
    assert_same(theirs, ours.load_sharded_state_dict(str(both), ["only.single", "transformer.wte.weight"]))


def test_is_in_safetensors_format_agrees(dirs):
    answers = {
        name: (real.is_in_safetensors_format(path), ours.is_in_safetensors_format(path)) for name, path in dirs.items()
    }
    assert answers == {
        "hf_single": (True, True),
        "hf_sharded": (True, True),
        "hf_bin": (False, False),
        "ckptd": (True, True),
        "ckptd_modelopt": (True, True),
        "empty": (False, False),
        "missing": (False, False),
    }
    assert ours.is_in_safetensors_format(str(dirs["hf_single"])) is True  # a str as well as a Path


def rank_keys(state: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank 0 of 2 holds the embeddings and block 0, rank 1 block 1, the final norm and the head."""
    if world == 1:
        return state
    second = [k for k in state if k.startswith(("transformer.h.1.", "transformer.ln_f.", "lm_head."))]
    return {k: v for k, v in state.items() if (k in second) == (rank == 1)}


def save_with_both(rank: int, world: int, root: str) -> dict[str, str]:
    """Each rank saves its part of the untied and the tied model with both libraries."""
    outcome = {}
    for tied in ("untied", "tied"):
        shard = rank_keys(gpt2(tied == "tied").state_dict(), rank, world)
        ours.save_sharded_model(shard, Path(root, tied, "ckptd", "model.safetensors"))
        try:
            real.save_sharded_model(shard, Path(root, tied, "modelopt", "model.safetensors"))
            outcome[tied] = "saved"
        except RuntimeError as e:  # safetensors refuses tensors that share memory (a tied head)
            outcome[tied] = f"refused: {e}"
    return outcome


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_save_sharded_model_files_read_both_ways(tmp_path, world):
    for tied in ("untied", "tied"):
        (tmp_path / tied / "ckptd").mkdir(parents=True)
        (tmp_path / tied / "modelopt").mkdir()  # ModelOpt writes into an existing directory
    outcomes = run_ranks(world, save_with_both, str(tmp_path))
    for tied in ("untied", "tied"):
        check_saved_files(tmp_path / tied, world, tied == "tied", [o[tied] for o in outcomes.values()])


def check_saved_files(root: Path, world: int, tied: bool, outcome: list[str]) -> None:
    model = gpt2(tied)
    mine = root / "ckptd"
    shard_names = [f"model-{r + 1:05d}-of-{world:05d}.safetensors" for r in range(world)]
    written = sorted(os.listdir(mine))
    assert written == sorted([*shard_names, "model.safetensors.index.json"])
    index = json.loads((mine / "model.safetensors.index.json").read_text())
    expected = stored_state(model) if world == 1 else model.state_dict()  # a tie split over ranks is two tensors
    assert set(index["weight_map"]) == set(expected)

    # ckptd's files: ModelOpt's loader, ckptd's, and transformers read the same tensors
    assert_same(expected, real.load_sharded_state_dict(str(mine)))
    assert_same(expected, ours.load_sharded_state_dict(str(mine)))
    model.config.save_pretrained(mine)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(mine)
    assert_same(model.state_dict(), loaded.state_dict())

    theirs = root / "modelopt"
    if tied and world == 1:  # ModelOpt cannot save a tied model in one shard; ckptd stores the tie once
        assert all(v.startswith("refused") and "share memory" in v for v in outcome), outcome
        assert "param_sharing" in index["metadata"]
        # and ModelOpt's index was written before the shard that failed: it names a missing file
        assert sorted(os.listdir(theirs)) == ["model.safetensors.index.json"]
        return
    assert outcome == ["saved"] * world
    # ModelOpt's files: the same names and index, read by ckptd
    assert sorted(os.listdir(theirs)) == written
    their_index = json.loads((theirs / "model.safetensors.index.json").read_text())
    assert their_index == index
    assert_same(expected, ours.load_sharded_state_dict(str(theirs)))
    assert_same(expected, ckptd.load_checkpoint(str(theirs)))
    assert ours.is_in_safetensors_format(theirs) and real.is_in_safetensors_format(mine)


class GPT2Descriptor(descriptor_base.ModelDescriptor):
    """A ModelOpt block descriptor for GPT-2 (ModelOpt ships none): what a ModelOpt user writes."""

    @staticmethod
    def decoder_layer_cls():
        return transformers.models.gpt2.modeling_gpt2.GPT2Block

    @staticmethod
    def block_config_to_layer_overrides(block_config):
        return {}

    @staticmethod
    def init_rotary_embedding(model, runtime):
        return None

    @staticmethod
    def input_embedding_name():
        return "transformer.wte"

    @staticmethod
    def output_embedding_name():
        return "lm_head"

    @staticmethod
    def final_norm_name():
        return "transformer.ln_f"

    @staticmethod
    def layer_block_name(index):
        return f"transformer.h.{index}"

    @staticmethod
    def layer_name_predicates(num_layers):
        return {}


# The descriptor's counterpart: ModelOpt leaves what its descriptor does not name (wpe) on every rank.
GPT2_AS_DESCRIBED = ours.owned_keys_by_block(
    "transformer.h", first=["transformer.wte"], last=["transformer.ln_f", "lm_head"]
)


@pytest.mark.parametrize("owned", [{0}, {1}, {0, 1}], ids=["first", "last", "both"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_create_local_shard_keeps_the_same_keys(owned, tied):
    runtime = SimpleNamespace(dtype=torch.float32)
    theirs = real.create_local_shard_(gpt2(tied), owned, GPT2Descriptor, runtime)
    mine = ours.create_local_shard_(gpt2(tied), owned, GPT2_AS_DESCRIBED, runtime)
    assert_same(theirs.state_dict(), mine.state_dict())

    their_meta = real.create_sharded_model(runtime, GPT2Descriptor, gpt2(tied).config, owned)
    my_meta = ours.create_sharded_model(runtime, GPT2_AS_DESCRIBED, gpt2(tied).config, owned)
    assert {k: (v.shape, v.dtype, v.device) for k, v in their_meta.state_dict().items()} == {
        k: (v.shape, v.dtype, v.device) for k, v in my_meta.state_dict().items()
    }


def test_set_submodule_same_result():
    theirs, mine = gpt2(), gpt2()
    real.set_submodule(theirs, "transformer.h.1", torch.nn.Identity())
    ours.set_submodule(mine, "transformer.h.1", torch.nn.Identity())
    assert_same(theirs.state_dict(), mine.state_dict())
    assert isinstance(mine.transformer.h[1], torch.nn.Identity)
