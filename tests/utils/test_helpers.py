"""Accelerate's small helpers under mpaccel.utils (operations, other, modeling, constants),
mpaccel.state.is_initialized and the top-level synchronize_rng_states: each does what
Accelerate 1.15's does, on the same arguments."""

from __future__ import annotations

import collections
import sys
import warnings

import pytest
import torch

import mpaccel
from mpaccel import state as state_module
from mpaccel.testing import reset_state
from mpaccel.utils import (
    PROFILE_PATTERN_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_PATTERN_NAME,
    TORCH_DISTRIBUTED_OPERATION_TYPES,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    AutocastKwargs,
    DistributedType,
    TensorInformation,
    are_libraries_initialized,
    compile_regions,
    convert_bytes,
    convert_outputs_to_fp32,
    convert_to_fp32,
    extract_model_from_parallel,
    find_device,
    get_data_structure,
    get_grad_scaler,
    get_mixed_precision_context_manager,
    get_pretty_name,
    has_compiled_regions,
    ignorant_find_batch_size,
    initialize_tensors,
    is_peft_model,
    is_tensor_information,
    listify,
    merge_dicts,
    pad_input_tensors,
    recursive_getattr,
    slice_tensors,
)
from mpaccel.utils import imports as imports_module

local = pytest.mark.mpi(size=1)  # no communication: one process says all
Pair = collections.namedtuple("Pair", ["a", "b"])


@local
def test_data_structure_round_trip_keeps_containers_shapes_and_dtypes():
    data = {"x": torch.ones(2, 3), "y": [torch.zeros(4, dtype=torch.int64), Pair(
        torch.ones((), dtype=torch.bfloat16), "label")]}
    structure = get_data_structure(data)
    assert structure["x"] == TensorInformation(shape=torch.Size([2, 3]), dtype=torch.float32)
    assert is_tensor_information(structure["y"][0]) and not is_tensor_information(data["x"])
    assert isinstance(structure["y"][1], Pair) and structure["y"][1].b == "label"
    rebuilt = initialize_tensors(structure)
    assert rebuilt["x"].shape == (2, 3) and rebuilt["y"][0].dtype == torch.int64
    assert rebuilt["y"][1].a.shape == () and rebuilt["y"][1].a.dtype == torch.bfloat16


@local
def test_slice_tensors_and_listify():
    data = {"x": torch.arange(6).reshape(3, 2), "n": 7, "h": [torch.tensor([1.5, 2.5],
                                                               dtype=torch.bfloat16)]}
    sliced = slice_tensors(data, slice(1, 3), process_index=0, num_processes=2)
    assert sliced["x"].tolist() == [[2, 3], [4, 5]] and sliced["n"] == 7
    listed = listify(data)
    assert listed == {"x": [[0, 1], [2, 3], [4, 5]], "n": 7, "h": [[1.5, 2.5]]}


@local
def test_ignorant_find_batch_size_returns_none_where_find_batch_size_raises():
    assert ignorant_find_batch_size({"a": [torch.ones(5, 2)]}) == 5
    assert ignorant_find_batch_size([]) is None
    assert ignorant_find_batch_size({"a": "text"}) is None


@local
def test_convert_to_fp32_converts_half_floats_only():
    data = (torch.ones(2, dtype=torch.float16), {"b": torch.ones(2, dtype=torch.bfloat16)},
            torch.ones(2, dtype=torch.int32), torch.ones(2, dtype=torch.float64), "s")
    out = convert_to_fp32(data)
    assert [out[0].dtype, out[1]["b"].dtype, out[2].dtype, out[3].dtype] == [
        torch.float32, torch.float32, torch.int32, torch.float64]
    assert out[4] == "s"


@local
def test_convert_outputs_to_fp32_wraps_a_forward():
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    forward = convert_outputs_to_fp32(model.forward)
    out = forward(torch.ones(1, 3, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    assert forward.__wrapped__ == model.forward and forward.__name__ == "forward"


@local
@pytest.mark.parametrize(("batch", "processes", "expected"),
                         [(1, 2, 2), (3, 2, 4), (4, 3, 6), (3, 4, 4), (4, 6, 6), (1, 6, 6),
                          (8, 4, 8), (6, 4, 8), (9, 2, 10)])
def test_pad_input_tensors_grows_to_a_multiple_of_the_processes(batch, processes, expected):
    data = {"x": torch.arange(batch * 2).reshape(batch, 2) + 1, "y": [torch.ones(batch)]}
    out = pad_input_tensors(data, batch, processes)
    assert out["x"].shape == (expected, 2) and out["y"][0].shape == (expected,)
    assert torch.equal(out["x"][:batch], data["x"])
    assert not out["x"][batch:].any()  # the added rows are zeros


@local
def test_pad_input_tensors_along_another_dim():
    out = pad_input_tensors(torch.ones(2, 3), 3, 2, dim=1)
    assert out.shape == (2, 4) and out[:, 3].sum() == 0


@local
def test_find_device():
    assert find_device([1, {"a": None, "b": (torch.ones(1),)}]) == torch.device("cpu")
    assert find_device({"a": [1, "x"]}) is None


@local
def test_plain_helpers():
    destination = {"a": {"x": 1, "y": 2}, "b": 3}
    assert merge_dicts({"a": {"y": 20, "z": {"q": 1}}, "c": 4}, destination) is destination
    assert destination == {"a": {"x": 1, "y": 20, "z": {"q": 1}}, "b": 3, "c": 4}
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    assert recursive_getattr(model, "0.weight").shape == (3, 2)
    with pytest.raises(AttributeError):
        recursive_getattr(model, "0.missing")
    assert [convert_bytes(n) for n in (512, 1536, 3 * 2**20, 2**50 * 5)] == [
        "512 bytes", "1.5 KB", "3.0 MB", "5.0 PB"]
    assert get_pretty_name(torch.nn.Linear) == "Linear"
    assert get_pretty_name(model) == "Sequential"
    assert get_pretty_name(test_plain_helpers) == "test_plain_helpers"
    assert are_libraries_initialized("torch", "surely_not_a_library") == ["torch"]


@local
def test_is_peft_model_unwraps_the_model(tmp_path, monkeypatch, request):
    """peft is not a dependency: a package of that name on the path stands in for it, so the
    unwrapping and the isinstance test are what is checked."""
    assert is_peft_model(torch.nn.Linear(1, 1)) is False
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "__init__.py").write_text(
        "import torch\nclass PeftModel(torch.nn.Module):\n    pass\n")
    (tmp_path / "peft-0.0.dist-info").mkdir()
    (tmp_path / "peft-0.0.dist-info" / "METADATA").write_text("Name: peft\nVersion: 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "peft", raising=False)
    imports_module._installed.cache_clear()  # availability is cached per process
    request.addfinalizer(imports_module._installed.cache_clear)
    import peft

    assert is_peft_model(torch.nn.DataParallel(peft.PeftModel())) is True
    assert is_peft_model(torch.nn.Linear(1, 1)) is False


@local
def test_constants_have_accelerates_values():
    assert (WEIGHTS_NAME, WEIGHTS_INDEX_NAME) == ("pytorch_model.bin",
                                                  "pytorch_model.bin.index.json")
    assert (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) == ("model.safetensors",
                                                            "model.safetensors.index.json")
    assert SAFE_WEIGHTS_PATTERN_NAME.format(suffix="-00001-of-00002") == (
        "model-00001-of-00002.safetensors")
    assert PROFILE_PATTERN_NAME.format(suffix=3) == "profile_3.json"
    assert {"MULTI_CPU", "MULTI_GPU", "FSDP"} <= set(TORCH_DISTRIBUTED_OPERATION_TYPES)
    assert DistributedType.NO.value not in TORCH_DISTRIBUTED_OPERATION_TYPES


@local
def test_get_grad_scaler_scales_on_this_device():
    scaler = get_grad_scaler(init_scale=64.0)
    assert scaler.is_enabled() and scaler.get_scale() == 64.0
    loss = torch.ones((), requires_grad=True) * 2
    assert scaler.scale(loss).item() == 128.0
    sharded = get_grad_scaler(DistributedType.FSDP, init_scale=8.0)
    assert type(sharded).__name__ == "ShardedGradScaler" and sharded.get_scale() == 8.0


@pytest.mark.parametrize(("precision", "dtype"),
                         [("bf16", torch.bfloat16), ("fp16", torch.float16), ("no", None)])
def test_get_mixed_precision_context_manager_follows_the_state(precision, dtype):
    reset_state()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp16 on CPU warns; not what is tested here
            accelerator = mpaccel.Accelerator(cpu=True, mixed_precision=precision)
        model = torch.nn.Linear(2, 2)
        with get_mixed_precision_context_manager(native_amp=False):
            assert model(torch.ones(1, 2)).dtype == torch.float32
        with get_mixed_precision_context_manager(native_amp=True):
            assert model(torch.ones(1, 2)).dtype == (dtype or torch.float32)
        handler = AutocastKwargs(enabled=False)
        with get_mixed_precision_context_manager(True, autocast_kwargs=handler):
            assert model(torch.ones(1, 2)).dtype == torch.float32
        assert accelerator.mixed_precision == precision
    finally:
        reset_state()


def test_is_initialized_follows_the_accelerator_state():
    reset_state()
    try:
        assert state_module.is_initialized() is False
        mpaccel.PartialState()
        assert state_module.is_initialized() is False  # PartialState alone is not enough
        mpaccel.Accelerator(cpu=True)
        assert state_module.is_initialized() is True
    finally:
        reset_state()
    assert state_module.is_initialized() is False


def test_top_level_synchronize_rng_states_gives_every_rank_rank_0s_state(state):
    torch.manual_seed(1000 + state.process_index)
    mpaccel.synchronize_rng_states(["torch"])
    drawn = torch.rand(4)
    everyone = state.comm.allgather(drawn.tolist())
    assert all(row == everyone[0] for row in everyone)
    torch.manual_seed(1000)
    assert drawn.tolist() == torch.rand(4).tolist()  # rank 0's, on every rank


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(3, 4)
        self.body = torch.nn.Sequential(torch.nn.ModuleList([Block(), Block(), Block()]))
        self.head = torch.nn.Linear(4, 2)
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.body[0]:
            x = block(x)
        return self.head(x) * self.scale


@local
def test_compile_regions_compiles_each_repeated_block_and_shares_the_weights():
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(5, 3)
    expected = model(x)
    compiled = compile_regions(model, backend="eager")
    compiled_module = torch._dynamo.eval_frame.OptimizedModule
    blocks = compiled.body[0]
    assert isinstance(blocks, torch.nn.ModuleList) and len(blocks) == 3
    assert all(isinstance(b, compiled_module) and isinstance(b._orig_mod, Block) for b in blocks)
    assert isinstance(compiled.embed, compiled_module)
    assert isinstance(compiled.head, compiled_module)
    assert type(compiled) is Tiny and compiled.scale == 0.5 and compiled._orig_mod is model
    # the user's model is left as it was, and shares its parameters with the compiled one
    assert not has_compiled_regions(model) and has_compiled_regions(compiled)
    assert isinstance(model.body[0][0], Block) and isinstance(model.embed, torch.nn.Linear)
    assert [id(p) for p in compiled.parameters()] == [id(p) for p in model.parameters()]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.testing.assert_close(compiled(x), expected)
    # the three blocks share one graph (the compiler's cache): embed, a block, head
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
    compiled(x).sum().backward()
    assert model.body[0][2].linear.weight.grad is not None


@local
def test_compile_regions_without_repeated_blocks_compiles_the_whole_model():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
    compiled = compile_regions(model, backend="eager")
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert compiled._orig_mod is model and has_compiled_regions(compiled)
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    assert not has_compiled_regions(torch.nn.Linear(2, 2))  # no submodules at all


def test_a_regionally_compiled_model_trains_in_step_across_ranks(comm):
    """prepare() wraps the regionally compiled model in DDP: the ranks' different batches give
    the same, averaged, update on every rank."""
    reset_state()
    try:
        accelerator = mpaccel.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = compile_regions(Tiny(), backend="eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        torch.manual_seed(100 + comm.rank)  # a different batch on each rank
        loss = model(torch.randn(4, 3)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        weight = accelerator.unwrap_model(model).body[0][1]._orig_mod.linear.weight
        rows = comm.allgather(weight.detach().flatten().tolist())
        assert all(row == rows[0] for row in rows)
        torch.manual_seed(0)
        assert weight.tolist() != Tiny().body[0][1].linear.weight.tolist()  # it did move
    finally:
        reset_state()


@local
@pytest.mark.slow  # inductor's first C++ build: ~30 s on 2 busy cores
def test_compile_regions_with_inductor_computes_the_same():
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(5, 3)
    compiled = compile_regions(model)
    torch.testing.assert_close(compiled(x), model(x))


# -- the names transformers and TRL import at Accelerate's module paths (issue 28) -------------


@local
def test_clean_device_map_groups_what_shares_a_device():
    from mpaccel.utils.modeling import clean_device_map

    device_map = {"a.x": 0, "a.y": 0, "b.x": 0, "b.y": 1, "c": "cpu"}
    assert clean_device_map(device_map) is device_map
    assert device_map == {"a": 0, "b.x": 0, "b.y": 1, "c": "cpu"}
    assert clean_device_map({"a.x": 0, "a.y": 0}) == {"": 0}  # the whole model on one device


@local
def test_get_max_layer_size_finds_the_largest_unsplit_layers():
    from mpaccel.utils import get_max_layer_size

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)

    model = torch.nn.Sequential(Block(), torch.nn.Linear(4, 4))
    sizes = {"0": 15, "0.a": 6, "0.b": 9, "1": 20}
    modules = list(model.named_children())
    assert get_max_layer_size(modules, sizes, []) == (20, ["1"])
    assert get_max_layer_size(modules[:1], sizes, []) == (9, ["0.b"])
    assert get_max_layer_size(modules[:1], sizes, ["Block"]) == (15, ["0"])
    assert get_max_layer_size(modules[:1], {"0.a": 9, "0.b": 9}, []) == (9, ["0.a", "0.b"])


@local
def test_fsdp_constants_versions_and_parameters_from_modules():
    from mpaccel.utils import compare_versions, constants, fsdp_utils, is_torch_version, versions

    assert "FULL_SHARD" in constants.FSDP_SHARDING_STRATEGY
    assert constants.FSDP_AUTO_WRAP_POLICY == ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP",
                                               "NO_WRAP"]
    assert versions.is_torch_version is is_torch_version
    assert versions.compare_versions is compare_versions
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    found = fsdp_utils.get_parameters_from_modules("1", model, "cpu")
    assert found == set(model[1].parameters())
    assert fsdp_utils.get_parameters_from_modules([model[0]], model, "cpu") == set(
        model[0].parameters())
    assert fsdp_utils.get_parameters_from_modules(None, model, "cpu") == set()


@local
def test_deepspeed_and_big_modeling_names_import_and_refuse_when_used():
    from mpaccel import big_modeling, parallelism_config
    from mpaccel.errors import ConfigurationError
    from mpaccel.utils import deepspeed

    assert deepspeed.HfDeepSpeedConfig is mpaccel.utils.HfDeepSpeedConfig
    with pytest.raises(ConfigurationError, match="HINT: "):
        deepspeed.HfDeepSpeedConfig({})
    with pytest.raises(AttributeError):
        deepspeed.no_such_name  # noqa: B018
    with pytest.raises(ConfigurationError, match="HINT: "):
        big_modeling.check_device_map(torch.nn.Linear(1, 1), {})
    assert big_modeling.init_empty_weights is mpaccel.init_empty_weights
    assert parallelism_config.ParallelismConfig is mpaccel.ParallelismConfig
