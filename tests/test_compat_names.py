"""Names and behaviours Accelerate scripts rely on beyond the training loop: enums, availability
helpers, memory helpers, nested-structure helpers, the state objects' attributes, pickling and
reset, save/load pre-hooks, refused plugins, and Accelerate's signatures."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import pickle
import warnings
import weakref
from collections import namedtuple
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import mpaccel
from mpaccel import Accelerator, AcceleratorState, PartialState
from mpaccel.errors import CollectiveError, ConfigurationError
from mpaccel.testing import reset_state
from mpaccel.utils import DistributedType, LoggerType

# -- enums and names -----------------------------------------------------------------------------

# Accelerate 1.15's members, value by value (accelerate/utils/dataclasses.py)
ACCELERATE_ENUMS = {
    "DistributedType": [
        "NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
        "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON",
    ],
    "LoggerType": [
        "all", "aim", "tensorboard", "wandb", "trackio", "comet_ml", "mlflow", "clearml",
        "dvclive", "swanlab",
    ],
    "PrecisionType": ["no", "fp8", "fp16", "bf16"],
    "RNGType": [
        "torch", "cuda", "mlu", "sdaa", "musa", "npu", "xla", "xpu", "hpu", "neuron", "generator",
    ],
    "DynamoBackend": [
        "NO", "EAGER", "AOT_EAGER", "INDUCTOR", "AOT_TS_NVFUSER", "NVPRIMS_NVFUSER", "CUDAGRAPHS",
        "OFI", "FX2TRT", "ONNXRT", "TENSORRT", "AOT_TORCHXLA_TRACE_ONCE", "TORCHXLA_TRACE_ONCE",
        "TVM", "HPU_BACKEND", "NEURON",
    ],
    "DDPCommunicationHookType": ["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"],
}


def test_enums_have_every_member_accelerate_has():
    import mpaccel.utils as utils
    from mpaccel.utils import DynamoBackend, PrecisionType, RNGType

    for name, values in ACCELERATE_ENUMS.items():
        enum = getattr(utils, name)
        assert [member.value for member in enum] == values, name
        assert enum.list() == values
    assert DistributedType.MULTI_NEURON == "MULTI_NEURON" and str(LoggerType.TRACKIO) == "trackio"
    assert "fp16" in PrecisionType and "fp4" not in PrecisionType
    assert RNGType("generator") is RNGType.GENERATOR and "INDUCTOR" in DynamoBackend


def test_accelerate_top_level_names():
    # accelerate/__init__.py's names that mpaccel provides (docs/training.md lists them)
    from mpaccel import (
        AutocastKwargs,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        ProfileKwargs,
        find_executable_batch_size,
        is_rich_available,
    )
    from mpaccel.utils import memory, operations

    assert DistributedDataParallelKwargs is mpaccel.utils.DistributedDataParallelKwargs
    assert AutocastKwargs is mpaccel.utils.AutocastKwargs and GradScalerKwargs
    assert ProfileKwargs is mpaccel.utils.ProfileKwargs and DDPCommunicationHookType
    assert find_executable_batch_size is memory.find_executable_batch_size
    assert operations.DistributedOperationException is mpaccel.errors.DistributedOperationException
    assert isinstance(is_rich_available(), bool)
    assert set(mpaccel.__all__) <= set(dir(mpaccel))
    assert set(mpaccel.utils.__all__) <= set(dir(mpaccel.utils))


# -- availability helpers ------------------------------------------------------------------------


def _really_installed(module: str) -> bool:
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.metadata.metadata(module)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize(
    "helper, module",
    [
        ("is_tensorboard_available", "tensorboard"),
        ("is_wandb_available", "wandb"),
        ("is_datasets_available", "datasets"),
        ("is_transformers_available", "transformers"),
        ("is_deepspeed_available", "deepspeed"),
        ("is_comet_ml_available", "comet_ml"),
        ("is_clearml_available", "clearml"),
        ("is_dvclive_available", "dvclive"),
        ("is_swanlab_available", "swanlab"),
        ("is_pytest_available", "pytest"),
        ("is_rich_available", "rich"),
        ("is_torchvision_available", "torchvision"),
    ],
)
def test_package_helpers_tell_what_is_installed_here(helper, module):
    import mpaccel.utils as utils

    assert getattr(utils, helper)() is _really_installed(module)


def test_device_and_version_helpers_tell_this_machine(tmp_path, monkeypatch):
    import mpaccel.utils as utils
    from mpaccel.utils.imports import _installed

    assert utils.is_cuda_available() is torch.cuda.is_available()
    for helper in ("is_xpu_available", "is_npu_available", "is_mlu_available",
                   "is_musa_available", "is_hpu_available", "is_torch_xla_available"):
        assert getattr(utils, helper)() is False, helper  # none of them on this machine
    if not torch.cuda.is_available():
        assert utils.is_bf16_available() is True  # CPUs compute in bf16
    assert utils.is_fp16_available() is True
    assert utils.is_torch_version(">=", "2.0") and not utils.is_torch_version("<", "2.0")
    assert utils.compare_versions("numpy", "==", np.__version__)
    assert utils.compare_versions("1.10.0", ">", "1.9")  # versions, not strings
    with pytest.raises(ValueError, match="operation"):
        utils.compare_versions("1.0", "=>", "1.0")
    # A directory that happens to bear a package's name is not the package
    (tmp_path / "mpaccel_fake_pkg").mkdir()
    (tmp_path / "mpaccel_fake_pkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("mpaccel_fake_pkg") is not None
    assert _installed("mpaccel_fake_pkg") is False
    assert _installed("numpy") is True


# -- memory helpers --------------------------------------------------------------------------


def test_release_memory_drops_the_references():
    from mpaccel.utils.memory import release_memory

    a, b = torch.ones(1000), torch.ones(10)
    watch = weakref.ref(a)
    a, b = release_memory(a, b)
    assert (a, b) == (None, None) and watch() is None


def _oom():
    return RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_find_executable_batch_size_agrees_on_the_batch_size(comm):
    """Every rank ends with the same batch size and the same attempts, even where only one
    rank ran out of memory (the others would otherwise have gone on alone)."""
    from mpaccel.utils.memory import find_executable_batch_size

    reset_state()
    PartialState()
    limit = 110 if comm.rank == comm.size - 1 else 1000  # the last rank has less memory
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > limit:
            raise _oom()
        return batch_size * scale

    assert train(2) == 2 * 103  # 128 -> 115 -> 103
    assert tried == [128, 115, 103]
    assert comm.allgather(tried) == [tried] * comm.size


def test_find_executable_batch_size_errors(comm):
    from mpaccel.utils.memory import find_executable_batch_size

    reset_state()
    PartialState()

    @find_executable_batch_size(starting_batch_size=4, reduce_batch_size_fn=lambda: 0)
    def never_fits(batch_size):
        raise _oom()

    with pytest.raises(ConfigurationError, match="no batch size fits"):
        never_fits()

    @find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size):
        if comm.rank == 0:
            raise ValueError("Oops, we had an error!")
        return batch_size

    with pytest.raises(CollectiveError, match="Oops, we had an error!") as info:
        broken()  # every rank, not only rank 0, learns of it
    assert info.value.failed_ranks == [0]

    @find_executable_batch_size(starting_batch_size=8)
    def takes_batch_size(batch_size, arg):
        return arg

    with pytest.raises(TypeError, match="passes it itself"):
        takes_batch_size(8, "x")


# -- collective operations -------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_shape_mismatches_raise_distributed_operation_exception(comm):
    """Accelerate's test_op_checker: shapes that cannot be combined raise its
    DistributedOperationException (on every rank), which is also a CollectiveError here."""
    from mpaccel.errors import DistributedOperationException as Raised
    from mpaccel.utils import broadcast, pad_across_processes, reduce
    from mpaccel.utils.operations import DistributedOperationException

    assert DistributedOperationException is Raised
    reset_state()
    acc = Accelerator()
    if comm.rank == 0:
        data = {"tensor": torch.tensor([[0.0, 1, 2, 3, 4]])}
    else:
        data = {"tensor": torch.tensor([[[0.0, 1, 2, 3, 4, 5]]])}
    for call in (lambda: pad_across_processes(data, dim=0), lambda: reduce(data),
                 lambda: broadcast(data), lambda: acc.gather(data)):
        with pytest.raises(DistributedOperationException) as info:
            call()
        assert isinstance(info.value, CollectiveError) and isinstance(info.value, ValueError)
        assert "rank 0: (1, 5)" in str(info.value)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is DistributedOperationException and str(copy) == str(info.value)
    acc.wait_for_everyone()  # still in step


# -- nested structures and models --------------------------------------------------------------


def test_structure_helpers():
    from mpaccel.utils import concatenate, find_batch_size, recursively_apply

    Pair = namedtuple("Pair", "a b")
    data = {"x": [torch.ones(3, 2), (torch.zeros(3), "text")], "p": Pair(torch.ones(3), 1)}
    doubled = recursively_apply(lambda t, k: t * k, data, 2)
    assert type(doubled["p"]) is Pair and doubled["p"].b == 1 and doubled["x"][1][1] == "text"
    assert torch.equal(doubled["x"][0], torch.full((3, 2), 2.0))
    with pytest.raises(TypeError, match="str"):
        recursively_apply(torch.neg, ["a"], error_on_other_type=True)
    assert find_batch_size(data) == 3
    with pytest.raises(ValueError, match="empty"):
        find_batch_size([])
    with pytest.raises(TypeError, match="tensors"):
        find_batch_size(["a"])
    batch = {"x": [torch.ones(3, 2), (torch.zeros(3),)], "p": Pair(torch.ones(3), torch.ones(3))}
    joined = concatenate([batch, batch])
    assert joined["x"][0].shape == (6, 2) and type(joined["p"]) is Pair
    assert joined["p"].a.shape == (6,) and joined["x"][1][0].shape == (6,)
    with pytest.raises(TypeError, match="tensors"):
        concatenate([["a"], ["b"]])


def test_extract_model_from_parallel_and_wait_for_everyone(comm):
    from mpaccel.utils import extract_model_from_parallel, wait_for_everyone

    reset_state()
    acc = Accelerator()
    inner = torch.nn.Linear(2, 2)
    model = acc.prepare(inner)
    assert extract_model_from_parallel(model) is inner
    wait_for_everyone()


# -- the state objects -------------------------------------------------------------------------


def test_state_attributes_accelerate_scripts_read(comm):
    reset_state()
    acc = Accelerator(dynamo_plugin=None, parallelism_config=None, torch_tp_plugin=None)
    state = acc.state
    assert state.is_fsdp2 is False and acc.is_fsdp2 is False
    assert state.device_mesh is None and acc.torch_device_mesh is None
    assert state.fsdp_plugin is None and state.torch_tp_plugin is None
    assert state.parallelism_config is None and state.megatron_lm_plugin is None
    assert state.dynamo_plugin.backend == "NO"
    assert state.is_main_process == (comm.rank == 0) and state.use_distributed == (comm.size > 1)
    assert acc.native_amp is False and acc.use_seedable_sampler is False
    assert acc.non_blocking is False and acc.should_save_model == acc.is_local_main_process
    with pytest.raises(AttributeError, match="'AcceleratorState' object has no attribute 'nope'"):
        state.nope  # noqa: B018  (it named PartialState)


def test_after_a_reset_the_error_explains_it(comm):
    """Accelerate's test_reinstantiated_state: prepare() after AcceleratorState._reset_state()."""
    reset_state()
    accelerator = Accelerator()
    AcceleratorState._reset_state()
    with pytest.raises(AttributeError) as info:
        accelerator.prepare(torch.nn.Linear(1, 1))
    assert "`AcceleratorState` object has no attribute" in str(info.value.args[0])
    assert "This happens if `AcceleratorState._reset_state()`" in str(info.value.args[0])
    state = PartialState()
    PartialState._reset_state()
    with pytest.raises(AttributeError, match=r"`PartialState\._reset_state"):
        state.device  # noqa: B018


def test_after_a_reset_process_control_still_answers(comm):
    """As Accelerate's: after AcceleratorState._reset_state() the state's and the accelerator's
    process control asks the process's PartialState (Accelerate's test_metrics reads
    accelerator.is_local_main_process then, test_script calls state.destroy_process_group())."""
    reset_state()
    accelerator = Accelerator()
    state = accelerator.state
    AcceleratorState._reset_state()
    assert accelerator.is_main_process is (comm.rank == 0) is state.is_main_process
    assert accelerator.is_local_main_process is state.is_local_main_process
    assert state.is_last_process is (comm.rank == comm.size - 1)
    assert state.use_distributed is (comm.size > 1)
    state.wait_for_everyone()
    accelerator.wait_for_everyone()
    with state.main_process_first(), state.split_between_processes([0, 1, 2, 3]) as share:
        assert share
    with pytest.raises(AttributeError, match=r"This happens if `AcceleratorState\._reset_state"):
        accelerator.device  # noqa: B018  (the configuration is gone, as in Accelerate)


def test_pickling_the_accelerator(comm):
    """Accelerate's test_pickle_accelerator, and the copy is usable in this process."""
    reset_state()
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(list(range(32)), batch_size=4))
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    unpickled = pickle.loads(pickle.dumps(accelerator))
    assert accelerator.state.__dict__ == unpickled.state.__dict__
    assert unpickled.state.__dict__ is accelerator.state.__dict__  # the process's state
    assert pickle.loads(pickle.dumps(accelerator.gradient_state)) is not None
    gathered = unpickled.gather(torch.tensor([comm.rank]))
    assert gathered.tolist() == list(range(comm.size))
    unpickled.wait_for_everyone()
    assert len(unpickled._dataloaders) == 1 and len(list(loader)) == len(list(
        unpickled._dataloaders[0]))
    assert model is not None


# -- plugins -----------------------------------------------------------------------------------


def test_plugins_of_other_engines_are_refused_with_a_hint(comm):
    from mpaccel.utils import (
        DeepSpeedPlugin,
        FullyShardedDataParallelPlugin,
        ParallelismConfig,
        TorchDynamoPlugin,
    )

    for name in ("torch_tp_plugin", "deepspeed_plugin", "deepspeed_plugins",
                 "megatron_lm_plugin"):
        reset_state()
        with pytest.raises(ConfigurationError, match=r"HINT: drop .*FullyShardedDataParallel"):
            Accelerator(**{name: object()})
    with pytest.raises(ConfigurationError, match="HINT"):
        DeepSpeedPlugin()
    # FSDP is driven (tests/strategy/test_fsdp.py): its plugins must be the real classes.
    for name, cls in (("fsdp_plugin", FullyShardedDataParallelPlugin),
                      ("parallelism_config", ParallelismConfig)):
        reset_state()
        with pytest.raises(ConfigurationError, match=f"must be a {cls.__name__}"):
            Accelerator(**{name: object()})
    reset_state()
    with pytest.raises(ConfigurationError, match="not both"):
        Accelerator(dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin())
    with pytest.raises(ConfigurationError, match="not a dynamo backend"):
        TorchDynamoPlugin(backend="warp-drive")
    regional = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
    assert regional.to_kwargs() == {"backend": "inductor"}  # not torch.compile's argument
    plugin = TorchDynamoPlugin(backend="inductor", mode="max-autotune")
    assert plugin.to_kwargs() == {"backend": "inductor", "mode": "max-autotune"}


# -- save_state / load_state pre-hooks ---------------------------------------------------------


def _two_models(acc):
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(2, 2)
    return acc.prepare(a, b)


def _fill(model, value):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def test_save_and_load_state_pre_hooks(comm, mpi_tmp_path):
    """diffusers' pattern: the hooks save and load the second model themselves (weights.pop()
    / models.pop()); the checkpoint holds the first only."""
    reset_state()
    acc = Accelerator()
    model_a, model_b = _two_models(acc)
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", len(models), len(weights), output_dir))
        assert len(models) == 2 and all(isinstance(w, dict) for w in weights)
        import os

        assert os.path.isdir(output_dir)
        weights.pop()  # model_b: saved here, not in the checkpoint
        if acc.is_main_process:
            torch.save(acc.unwrap_model(models[1]).state_dict(), f"{output_dir}/b.pt")

    def second_hook(models, weights, output_dir):
        calls.append(("second", len(weights)))

    def load_hook(models, input_dir):
        calls.append(("load", len(models), input_dir))
        b = models.pop()
        acc.unwrap_model(b).load_state_dict(torch.load(f"{input_dir}/b.pt"))

    handles = [acc.register_save_state_pre_hook(save_hook),
               acc.register_save_state_pre_hook(second_hook)]
    acc.register_load_state_pre_hook(load_hook)
    _fill(model_a, 1.0)
    _fill(model_b, 2.0)
    directory = str(mpi_tmp_path / "ckpt")
    assert acc.save_state(directory) == directory
    assert calls == [("save", 2, 2, directory), ("second", 1)]  # in order; the pop is seen
    acc.wait_for_everyone()

    from mpaccel.checkpoint.reader import CheckpointReader

    with CheckpointReader(directory, "state") as reader:
        assert "model_0" in reader.components() and "model_1" not in reader.components()

    _fill(model_a, 5.0)
    _fill(model_b, 7.0)
    acc.load_state(directory)
    assert calls[-1] == ("load", 2, directory)
    assert all(torch.all(p == 1.0) for p in model_a.parameters())  # by the checkpoint
    assert all(torch.all(p == 2.0) for p in model_b.parameters())  # by the hook

    handles[0].remove()
    handles[1].remove()
    calls.clear()
    acc.save_state(str(mpi_tmp_path / "again"))
    assert calls == []  # removed
    with pytest.raises(CollectiveError, match=r"b\.pt"):
        acc.load_state(str(mpi_tmp_path / "again"))  # the load hook finds no b.pt there


def test_a_failing_hook_fails_every_rank(comm, mpi_tmp_path):
    reset_state()
    acc = Accelerator()
    _two_models(acc)

    def hook(models, weights, output_dir):
        if comm.rank == comm.size - 1:
            raise RuntimeError("hook broke")

    acc.register_save_state_pre_hook(hook)
    with pytest.raises(CollectiveError, match="hook broke") as info:
        acc.save_state(str(mpi_tmp_path / "ckpt"))
    assert info.value.failed_ranks == [comm.size - 1]


def test_save_state_second_argument_is_safe_serialization(comm, mpi_tmp_path):
    """save_state(d, True) is Accelerate's safe_serialization=True: a synchronous save (it
    started a background save); async_save is keyword-only."""
    reset_state()
    acc = Accelerator()
    _two_models(acc)
    acc.save_state(str(mpi_tmp_path / "a"), True)
    assert not acc._async_saver.busy and acc._async_saver._thread is None
    with pytest.raises(TypeError):
        acc.save_state(str(mpi_tmp_path / "b"), True, True)  # type: ignore[misc]
    assert "async_save" in inspect.signature(acc.save_state).parameters


# -- signatures --------------------------------------------------------------------------------

# (method, Accelerate 1.15's parameter names in order, with defaults where it has them)
ACCELERATE_SIGNATURES = [
    ("unwrap_model", ["model", "keep_fp32_wrapper=True", "keep_torch_compile=True"]),
    ("prepare_optimizer", ["optimizer", "device_placement=None"]),
    ("prepare_data_loader", ["data_loader", "device_placement=None",
                             "slice_fn_for_dispatch=None"]),
    ("save_state", ["output_dir=None", "safe_serialization=True"]),
    ("load_state", ["input_dir=None", "load_kwargs=None"]),
    ("profile", ["profile_handler=None"]),
    ("register_save_state_pre_hook", ["hook"]),
    ("register_load_state_pre_hook", ["hook"]),
    ("prepare_model", ["model", "device_placement=None", "evaluation_mode=False"]),
    ("join_uneven_inputs", ["joinables", "even_batches=None"]),
    ("clip_grad_norm_", ["parameters", "max_norm", "norm_type=2"]),
]


def _spelled(parameter):
    if parameter.default is inspect.Parameter.empty:
        return parameter.name
    return f"{parameter.name}={parameter.default!r}"


@pytest.mark.parametrize("method, expected", ACCELERATE_SIGNATURES)
def test_accelerator_signatures_follow_accelerate(method, expected):
    params = [
        p for p in inspect.signature(getattr(Accelerator, method)).parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)
    ]
    assert [_spelled(p) for p in params][: len(expected)] == expected


def test_other_signatures_follow_accelerate():
    from mpaccel.utils import gather_object

    assert isinstance(inspect.getattr_static(Accelerator, "trigger_sync_in_backward"),
                      staticmethod)
    assert list(inspect.signature(gather_object).parameters) == ["object"]
    init = [p.name for p in inspect.signature(Accelerator).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert init == [
        "device_placement", "split_batches", "mixed_precision", "gradient_accumulation_steps",
        "cpu", "dataloader_config", "deepspeed_plugin", "fsdp_plugin", "torch_tp_plugin",
        "megatron_lm_plugin", "rng_types", "log_with", "project_dir", "project_config",
        "gradient_accumulation_plugin", "step_scheduler_with_optimizer", "kwargs_handlers",
        "dynamo_backend", "dynamo_plugin", "deepspeed_plugins", "parallelism_config",
    ]
    for name in ("wait_for_everyone", "print", "is_main_process", "use_distributed"):
        assert hasattr(AcceleratorState, name)  # on the class, as Accelerate's
    state_init = [p.name for p in inspect.signature(AcceleratorState).parameters.values()]
    assert state_init[:8] == [
        "mixed_precision", "cpu", "dynamo_plugin", "deepspeed_plugin", "fsdp_plugin",
        "torch_tp_plugin", "megatron_lm_plugin", "parallelism_config",
    ]


def test_prepare_optimizer_places_its_state_on_the_device(comm):
    reset_state()
    acc = Accelerator()
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    prepared = acc.prepare_optimizer(opt, device_placement=True)
    after = prepared.optimizer.state[model.weight]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert after["exp_avg"].device.type == acc.device.type


# -- join_uneven_inputs warnings (Accelerate's test_distributed_data_loop) ---------------------


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_join_warns_for_set_ups_it_cannot_join(comm):
    """test_join_raises_warning_for_non_ddp_distributed: a UserWarning, nothing joined."""
    reset_state()
    accelerator = Accelerator()
    original = accelerator.state.distributed_type
    accelerator.state.distributed_type = DistributedType.FSDP
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with accelerator.join_uneven_inputs([Mock()]):
                pass
            assert issubclass(w[-1].category, UserWarning)
            assert "only supported for multi-GPU" in str(w[-1].message)
    finally:
        accelerator.state.distributed_type = original


@pytest.mark.mpi(min_size=2)
def test_join_warns_when_iterable_loaders_keep_even_batches(comm):
    """test_join_raises_warning_for_iterable_when_overriding_even_batches."""
    reset_state()
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    accelerator.prepare(DataLoader(_Stream(), batch_size=1))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=False):
            pass
        assert issubclass(w[-1].category, UserWarning)
        assert "only supported for map-style datasets" in str(w[-1].message)

