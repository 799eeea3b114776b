"""FSDP2 with Hugging Face models (mpaccel/fsdp.py, mpaccel/sharding.py): tied weights (GPT-2's
head and embedding, BERT's decoder weight and bias) stay tied through sharding with and without
cpu_ram_efficient_loading, generate() runs sharded, and unwrap_model() says how to save.

Tiny models built from local configs, dropout off; the reference is one process with the
global batch, computed in the same test on every rank."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from mpaccel import Accelerator
from mpaccel.errors import CollectiveError, ConfigurationError
from mpaccel.utils import FullyShardedDataParallelPlugin
from tests.conftest import accelerator

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("no_group_left_behind")

VOCAB, LENGTH, GLOBAL_BATCH, STEPS = 64, 12, 12, 3  # batch divisible by 1, 2, 3 and 4


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=LENGTH, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


BUILD = {"gpt2": _gpt2, "bert": _bert}


def _built(kind: str, meta: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if not meta:
        return BUILD[kind]()
    with torch.device("meta"):
        return BUILD[kind]()


def _batches(kind: str, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """`count` global batches: token ids, and labels (the ids for causal LM; for MLM, three
    tokens of each row masked, the others labelled -100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(2, VOCAB, (GLOBAL_BATCH, LENGTH), generator=g)
        if kind == "gpt2":
            out.append({"input_ids": ids, "labels": ids.clone()})
            continue
        # As many masked tokens in each row: the mean of the ranks' losses is the batch's.
        order = torch.rand(ids.shape, generator=g).argsort(dim=1)
        masked = torch.zeros_like(ids, dtype=torch.bool).scatter_(1, order[:, :3], True)
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        out.append({"input_ids": torch.where(masked, torch.ones_like(ids), ids), "labels": labels})
    return out


def _eval_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    model.eval()
    with torch.no_grad():
        loss = model(**batch).loss.item()
    model.train()
    return loss


def _reference(kind: str) -> float:
    model = _built(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in _batches(kind, STEPS, seed=1):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return _eval_loss(model, _batches(kind, 1, seed=2)[0])


def _fresh(**fields) -> Accelerator:
    return accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(**fields))


def _tied_names(model: torch.nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return sorted(group for group in names.values() if len(group) > 1)


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("gpt2", {"cpu_ram_efficient_loading": True}),
        # BertEmbeddings would be a unit of its own, holding one name of the decoder's weight.
        ("bert", {"auto_wrap_policy": "transformer_based_wrap"}),
        ("bert", {"cpu_ram_efficient_loading": True,
                  "auto_wrap_policy": "transformer_based_wrap"}),
    ],
)  # fmt: skip
def test_tied_weights_train_as_one_process(comm, kind, fields):
    acc = _fresh(**fields)
    n, rank = acc.num_processes, acc.process_index
    before = _tied_names(_built(kind))
    model = _built(kind, meta=bool(fields.get("cpu_ram_efficient_loading")) and rank > 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    assert _tied_names(model) == before  # the sharing is back, one DTensor per group
    assert all(isinstance(model.get_parameter(g[0]), DTensor) for g in before)
    held = [id(p) for group in opt.param_groups for p in group["params"]]
    assert sorted(held) == sorted(id(p) for p in model.parameters())  # each shared one once
    share = GLOBAL_BATCH // n
    for batch in _batches(kind, STEPS, seed=1):
        mine = {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}
        acc.backward(model(**mine).loss)
        opt.step()
        opt.zero_grad()
    assert _tied_names(model) == before
    loss = _eval_loss(model, _batches(kind, 1, seed=2)[0])
    assert loss == pytest.approx(_reference(kind), rel=1e-5)


def test_tied_weights_survive_save_state_load_state_and_save_model(comm, mpi_tmp_path):
    def prepared(seed: int) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer]:
        acc = _fresh(cpu_ram_efficient_loading=True)
        torch.manual_seed(seed)
        model = _gpt2() if acc.is_main_process else _built("gpt2", meta=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return acc, *acc.prepare(model, opt)

    acc, model, opt = prepared(seed=0)
    acc.backward(model(**_batches("gpt2", 1, seed=1)[0]).loss)
    opt.step()
    acc.save_state(mpi_tmp_path / "state")
    acc.save_model(model, mpi_tmp_path / "model")
    saved = acc.get_state_dict(model, all_ranks=True)
    acc, model, opt = prepared(seed=7)  # other weights: the load must replace them
    acc.load_state(mpi_tmp_path / "state")
    assert model.lm_head.weight is model.transformer.wte.weight
    held = [id(p) for group in opt.param_groups for p in group["params"]]
    assert sorted(held) == sorted(id(p) for p in model.parameters())
    loaded = acc.get_state_dict(model, all_ranks=True)
    # the names of one parameter hold one tensor, as unsharded; the file keeps the first only
    assert saved["lm_head.weight"] is saved["transformer.wte.weight"]
    written = _built("gpt2")
    stored = safetensors_torch.load_file(mpi_tmp_path / "model/model.safetensors")
    assert "lm_head.weight" not in stored
    assert written.load_state_dict(stored, strict=False).missing_keys == ["lm_head.weight"]
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, msg=key)
        torch.testing.assert_close(written.state_dict()[key], value, msg=key)


def test_generate_runs_sharded_and_gives_one_process_tokens(comm):
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.T5ForConditionalGeneration(config).eval()
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    acc = _fresh(auto_wrap_policy="transformer_based_wrap")
    model = acc.prepare(model)
    ids = torch.randint(2, VOCAB, (3, 7), generator=torch.Generator().manual_seed(3))
    options = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    with torch.no_grad():
        tokens = acc.unwrap_model(model).generate(ids, **options)
        expected = reference.generate(ids, **options)
    assert torch.equal(tokens, expected)


class _Scorer(torch.nn.Module):
    """A root unit whose `score` uses the root's own parameters without calling forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def score(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).sum()


def test_plugin_forward_methods_gather_like_forward(comm):
    ids = torch.tensor([1, 2, 3])
    acc = _fresh(forward_methods=["score"])
    model = acc.prepare(_Scorer())
    torch.testing.assert_close(model.score(ids), _Scorer().score(ids))
    assert FullyShardedDataParallelPlugin(forward_methods="score").forward_methods == ["score"]
    for bad in (3, ["not a name"]):
        with pytest.raises(ConfigurationError, match="forward_methods"):
            FullyShardedDataParallelPlugin(forward_methods=bad)
    acc = _fresh(forward_methods=["rank"])
    with pytest.raises(CollectiveError, match=r"no method \['rank'\]"):
        acc.prepare(_Scorer())


def test_the_scripts_unchanged_save_pretrained_writes_the_whole_model(comm, mpi_tmp_path):
    """transformers' no_trainer scripts end with unwrap_model(model).save_pretrained(dir,
    is_main_process=..., save_function=accelerator.save) on every rank: under FSDP it writes
    the whole model, tied, equal to the trained state; state_dict() still gives the shards."""
    acc = _fresh(cpu_ram_efficient_loading=True)
    model = acc.prepare(_built("gpt2"))
    unwrapped = acc.unwrap_model(model)
    assert unwrapped is model
    unwrapped.save_pretrained(
        mpi_tmp_path, is_main_process=acc.is_main_process, save_function=acc.save
    )  # fmt: skip
    acc.wait_for_everyone()
    assert any(isinstance(v, DTensor) for v in model.state_dict().values())
    loaded = transformers.GPT2LMHeadModel.from_pretrained(mpi_tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    full = acc.get_state_dict(model, all_ranks=True)
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, full[key], msg=key)


@pytest.mark.mpi(min_size=2)
def test_save_pretrained_by_one_rank_alone_says_how(comm, mpi_tmp_path, monkeypatch):
    monkeypatch.setenv("MPACCEL_SOLO_SAVE_WAIT", "1")
    acc = _fresh()
    model = acc.prepare(_built("gpt2"))
    if acc.is_main_process:
        with pytest.raises(ConfigurationError, match=r"one rank alone(.|\n)*get_state_dict"):
            model.save_pretrained(mpi_tmp_path / "alone")
    acc.wait_for_everyone()
