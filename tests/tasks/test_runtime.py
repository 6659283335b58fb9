"""The `runtime` settings of every task that runs the network: `runtime.matmul_precision` (TF32 on a GPU, CPU
numbers unchanged), `runtime.cpu_mmap_threshold_mb` (freed CPU tensors go back to the OS) and `runtime.compile` (torch.compile of the network's repeated regions in train, eval and bench, with
plain checkpoint keys and the compile time in bench's rows). Compiling uses a cheap backend here (inductor takes
minutes on 2 CPU cores); inductor on a GPU is in tests/test_gpu.py."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch._dynamo import lookup_backend, register_backend
from torch._dynamo.utils import counters

from flowformer.tasks import bench, run_task
from flowformer.tasks.runtime import (
    ONEDNN_MATMUL,
    compile_network,
    configure_runtime,
    region_compile_settings,
)
from flowformer.tasks.train import fit

from helpers.compose import compose_tiny_config as config
from helpers.configs import build_backbone
from helpers.run import fresh_checkout, run_py

COMPILED_GRAPHS: list[torch.fx.GraphModule] = []


@register_backend
def recording_aot_eager(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """aot_eager (AOT autograd, no code generation), recording every graph dynamo hands it."""
    COMPILED_GRAPHS.append(graph)
    return lookup_backend("aot_eager")(graph, example_inputs)


@register_backend
def recording_eager(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """The captured graphs run as they are (the cheapest compile), recorded."""
    COMPILED_GRAPHS.append(graph)
    return graph.forward


@pytest.mark.usefixtures("restore_matmul_precision")
@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_matmul_precision_sets_torch_for_the_gpu_and_keeps_cpu_matmuls_strict(precision):
    configure_runtime(config(f"runtime.matmul_precision={precision}").runtime)
    assert torch.get_float32_matmul_precision() == precision
    assert torch.backends.cuda.matmul.allow_tf32 == torch.backends.cudnn.allow_tf32 == (precision != "highest")
    if ONEDNN_MATMUL is not None:
        assert ONEDNN_MATMUL.fp32_precision == "ieee"


@pytest.mark.usefixtures("restore_matmul_precision")
def test_tf32_is_the_default_and_cpu_flow_is_bitwise_the_strict_fp32_flow():
    assert config().runtime.matmul_precision == "high"
    torch.manual_seed(0)
    net = build_backbone().eval()
    images = [torch.rand(1, 3, 64, 96) * 255 for _ in range(2)]
    flows = {}
    for precision in ("highest", "high", "medium"):
        configure_runtime(config(f"runtime.matmul_precision={precision}").runtime)
        with torch.no_grad():
            flows[precision] = net(*images, iters=2)["flow"]
    assert torch.equal(flows["high"], flows["highest"]) and torch.equal(flows["medium"], flows["highest"])


@pytest.mark.usefixtures("restore_matmul_precision")
def test_a_bad_matmul_precision_is_one_error_naming_the_key(capsys):
    with pytest.raises(ValueError, match=r"runtime.matmul_precision='fast': expected one of highest, high"):
        configure_runtime(config("runtime.matmul_precision=fast").runtime)
    with pytest.raises(SystemExit) as exit_info:  # as run.py reports it, before any work
        run_task(config("task=eval", "eval=synthetic", "runtime.matmul_precision=tf32"))
    assert exit_info.value.code == 1
    assert "error (ValueError): runtime.matmul_precision='tf32'" in capsys.readouterr().err


RETAINED_AFTER_FREES = """
import json, sys, torch
from omegaconf import OmegaConf
from flowformer.tasks.runtime import configure_runtime
configure_runtime(OmegaConf.create(json.loads(sys.argv[1])))
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
torch.ones(4)  # torch's set-up at a process's first operator stays resident: 1 MiB on Python 3.11, 7 on 3.13
start = resident_mib()
for _ in range(3):
    tensor = torch.ones(20 * 2**18)  # 20 MiB, touched
    del tensor
print(resident_mib() - start)
"""


def measured_under(runtime, script: str) -> float:
    """The number `script` prints last, run in a fresh process under `runtime` (the allocator's settings last as
    long as the process), without run.py's huge pages."""
    settings = json.dumps(OmegaConf.to_container(runtime, resolve=True))
    result = subprocess.run(
        [sys.executable, "-c", script, settings], capture_output=True, text=True, check=True, env=without_huge_pages()
    )
    return float(result.stdout.strip().splitlines()[-1])


def without_huge_pages() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != "THP_MEM_ALLOC_ENABLE"}


def retained_mib(runtime) -> float:
    """Resident MiB a fresh process keeps after allocating and freeing a 20 MiB tensor three times under
    `runtime`."""
    return measured_under(runtime, RETAINED_AFTER_FREES)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_cpu_mmap_threshold_gives_freed_tensors_back_to_the_os():
    assert retained_mib(config().runtime) > 15  # by default the heap keeps a freed block
    assert retained_mib(config("runtime.cpu_mmap_threshold_mb=16").runtime) < 5


FAULTS_PER_LARGE_TENSOR = """
import json, resource, sys, torch
from omegaconf import OmegaConf
from flowformer.tasks.runtime import configure_runtime
configure_runtime(OmegaConf.create(json.loads(sys.argv[1])))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # 64 MiB, above glibc's largest mmap threshold, touched and freed: by default the heap
    torch.ones(64 * 2**18)  # grows to hold it and the small blocks that come between (2 to 5 such tensors)
start = faults()
for _ in range(3):
    torch.ones(64 * 2**18)
print((faults() - start) / 3)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_by_default_a_freed_large_tensor_is_reused_without_page_faults():
    """glibc maps every block above 32 MiB and unmaps it when freed, so each new one is faulted in afresh (a
    fault per 4 KiB page: 16384 for 64 MiB); by default (`cpu_mmap_threshold_mb: null`) the heap serves it again."""
    assert config().runtime.cpu_mmap_threshold_mb is None
    assert measured_under(config().runtime, FAULTS_PER_LARGE_TENSOR) < 100
    assert measured_under(config("runtime.cpu_mmap_threshold_mb=16").runtime, FAULTS_PER_LARGE_TENSOR) > 10000


HUGE_PAGES_AFTER_RUN_PY = """
import re, runpy, sys
sys.argv = ["run.py", "--cfg", "job"]  # Hydra prints the configuration and returns
runpy.run_path("run.py", run_name="__main__")
import torch
tensor = torch.ones(8 * 2**18)  # 8 MiB
pointer = tensor.data_ptr()
inside = False
for line in open("/proc/self/smaps"):
    bounds = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
    if bounds:
        inside = int(bounds[1], 16) <= pointer < int(bounds[2], 16)
    elif inside and line.startswith("VmFlags:"):
        print(line)
"""


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").is_dir(), reason="no transparent huge pages")
def test_run_py_has_torch_advise_huge_pages_for_large_cpu_tensors(tmp_path):
    """run.py sets THP_MEM_ALLOC_ENABLE before torch is imported (torch reads it once): a tensor of 8 MiB then
    lies in a mapping advised for huge pages (VmFlags `hg`), unless the environment says otherwise."""

    checkout = fresh_checkout(tmp_path)

    def flags(**env: str) -> list[str]:
        command = [sys.executable, "-c", HUGE_PAGES_AFTER_RUN_PY]
        environment = {**without_huge_pages(), **env}
        result = subprocess.run(command, cwd=checkout, env=environment, capture_output=True, text=True, check=True)
        return result.stdout.strip().splitlines()[-1].split()[1:]  # the tensor's mapping's VmFlags

    assert "hg" in flags()
    assert "hg" not in flags(THP_MEM_ALLOC_ENABLE="0")


def test_a_bad_cpu_mmap_threshold_is_one_error_naming_the_key():
    expected = r"runtime.cpu_mmap_threshold_mb=64: expected a size in MiB in \(0, 32\]"
    with pytest.raises(ValueError, match=expected):
        configure_runtime(config("runtime.cpu_mmap_threshold_mb=64").runtime)


def test_compile_is_off_by_default_and_leaves_the_network_alone():
    net = build_backbone()
    compile_network(net, config().runtime)
    assert all(module._compiled_call_impl is None for module in net.modules())
    assert net.memory_decoder.compiled_iteration is None


def test_compiled_network_gives_the_uncompiled_flow():
    torch.manual_seed(0)
    net = build_backbone().eval()
    reference = build_backbone().eval()
    reference.load_state_dict(net.state_dict())
    compile_network(net, config("runtime.compile=true", "runtime.compile_backend=recording_aot_eager").runtime)
    images = [torch.rand(1, 3, 64, 96) * 255 for _ in range(2)]
    COMPILED_GRAPHS.clear()
    with torch.no_grad():
        flow = net(*images, iters=1)["flow"]
        expected = reference(*images, iters=1)["flow"]
    assert COMPILED_GRAPHS  # the stages went through torch.compile
    torch.testing.assert_close(flow, expected)
    assert list(net.state_dict()) == list(reference.state_dict())


def compiled_graphs(
    iters: int, training: bool, then_validation: bool = False, **backbone
) -> list[torch.fx.GraphModule]:
    """The graphs torch.compile captures in the first step of the compiled tiny network (with `backbone`'s
    overrides) with `iters` decoder iterations (a forward, and its backward when `training`), then, with
    `then_validation`, an inference forward as Lightning's validation runs it in the same process, from an empty
    compile cache; checks that nothing broke a graph and that every frame compiled (none left eager)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = build_backbone(**backbone).train(training)
    compile_network(net, config("runtime.compile=true", "runtime.compile_backend=recording_eager").runtime)
    images = [torch.rand(1, 3, 64, 96) * 255 for _ in range(2)]
    COMPILED_GRAPHS.clear()
    with torch.set_grad_enabled(training):
        out = net(*images, iters=iters)
        if training:
            sum(flow.abs().mean() for flow in out["flow_predictions"]).backward()
    if then_validation:
        with torch.no_grad():
            net.eval()(*images, iters=iters)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # one graph per compiled frame, none failed or left eager
    assert counters["frames"]["total"] == counters["frames"]["ok"] == len(COMPILED_GRAPHS)
    return list(COMPILED_GRAPHS)


def graph_outputs(graph: torch.fx.GraphModule) -> int:
    (output,) = (node for node in graph.graph.nodes if node.op == "output")
    return len(output.args[0])


def symbolic_inputs(graph: torch.fx.GraphModule) -> list[str]:
    """The graph's inputs that are sizes or tensors of symbolic sizes: those of a graph for dynamic shapes."""
    symbolic = []
    for node in graph.graph.nodes:
        value = node.meta.get("example_value") if node.op == "placeholder" else None
        sizes = value.shape if isinstance(value, torch.Tensor) else [value]
        if any(isinstance(size, torch.SymInt) for size in sizes):
            symbolic.append(node.name)
    return symbolic


@pytest.mark.parametrize("image_encoder", ["cnn", "twins"])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_compiled_regions_are_static_at_each_shape(image_encoder, training):
    """The feature encoder runs on both images (batch 2), the context encoder on one (batch 1), and a Twins
    encoder's blocks at two widths: one compiled code at several shapes. Dynamo's automatic dynamic shapes
    recompiled such a region for symbolic sizes at its second shape, whose guards and sympy reasoning took
    11-16 s of tracing per Twins block (the official-size network's first forward at 128x192 traced in 55 s
    instead of 7.5 s on the CPU, docs/performance.md); each shape compiles a static graph instead."""
    graphs = compiled_graphs(2, training, image_encoder=image_encoder)
    assert {name for graph in graphs for name in symbolic_inputs(graph)} == set()


def test_training_then_validation_runs_every_region_compiled():
    """A training step and then a validation forward, as Lightning runs them in one process, compile each region
    in both modes: a Twins block's forward 16 times (8 shapes a mode), past dynamo's default limit of 8 compiles
    per function, after which the official-size network's validation ran its Twins blocks eagerly
    (`compiled_graphs` checks that every frame compiled)."""
    assert compiled_graphs(1, training=True, then_validation=True, image_encoder="twins")


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_compiling_does_not_grow_with_the_decoder_iterations(training):
    """The repeated regions compile once: 12 iterations capture the same graphs as 4 (no unrolled loop, no
    recompiles across iterations)."""
    sizes = [[len(graph.graph.nodes) for graph in compiled_graphs(iters, training)] for iters in (12, 4)]
    assert sizes[0] == sizes[1]


def test_a_compiled_decoder_iteration_returns_only_its_outputs_and_compiles_twice():
    """The graphs of the compiled decoder iteration (those of more than one output; the others return one tensor):
    one for the iterations without upsampling and one for the last, which upsamples (no third one for the first
    iteration, whose GRU state came in another memory format before). They return the GRU state, coords1 and
    flow_low, and flow_up where the iteration upsamples: nothing the code keeps for a later call. CUDA graphs
    (runtime.compile_mode=reduce-overhead) overwrite a graph's outputs at its next replay; the cost volume's
    window offsets, cached from inside the first iteration's graph as its fourth output, were overwritten so on
    an H200."""
    outputs = [graph_outputs(graph) for graph in compiled_graphs(3, training=False)]
    assert [count for count in outputs if count > 1] == [3, 4]


CALLED_GRAPHS: list[torch.fx.GraphModule] = []


@register_backend
def call_recording_eager(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """The captured graphs run as they are, every call recorded."""

    def run(*args):
        CALLED_GRAPHS.append(graph)
        return graph.forward(*args)

    return run


def graph_calls(net, iters: int) -> list[torch.fx.GraphModule]:
    """The compiled graphs an inference forward of `net` with `iters` decoder iterations calls, in order."""
    CALLED_GRAPHS.clear()
    with torch.no_grad():
        net(*[torch.rand(1, 3, 64, 96) * 255 for _ in range(2)], iters=iters)
    return list(CALLED_GRAPHS)


@pytest.mark.parametrize("decoder", ["cmd", "mcr"])
def test_a_compiled_decoder_iteration_is_one_graph(decoder):
    """Each refinement iteration calls one compiled graph, which holds the cost-window sampling, the update block
    and the convex upsampling (when the iteration upsamples): no eager code between compiled pieces."""
    torch._dynamo.reset()
    net = build_backbone(decoder=decoder, agt_depth=0 if decoder == "mcr" else 1).eval()
    compile_network(net, config("runtime.compile=true", "runtime.compile_backend=call_recording_eager").runtime)
    graph_calls(net, 2)  # compiles
    calls_4, calls_12 = graph_calls(net, 4), graph_calls(net, 12)
    assert len(calls_12) - len(calls_4) == 8
    last = {node.target for node in calls_12[-1].graph.nodes}  # the last iteration's graph
    assert {torch.nn.functional.grid_sample, torch.nn.functional.unfold, torch.sigmoid} <= last


@pytest.mark.parametrize("parts", [["decoder"], ["image_encoders", "cost_encoder"]], ids=["decoder", "encoders"])
def test_compile_regions_compiles_those_parts_alone(parts):
    """runtime.compile_regions=[decoder]: a forward calls compiled graphs at its decoder's iterations only, one
    each; without the decoder, the iterations run eagerly (as many graph calls at 12 iterations as at 4) and the
    encoders' regions are compiled. Each part alone is a shorter compile (docs/performance.md)."""
    torch._dynamo.reset()
    net = build_backbone().eval()
    regions = ",".join(parts)
    settings = config("runtime.compile=true", "runtime.compile_backend=call_recording_eager",
                      f"runtime.compile_regions=[{regions}]").runtime
    compile_network(net, settings)
    graph_calls(net, 2)  # compiles
    calls_4, calls_12 = graph_calls(net, 4), graph_calls(net, 12)
    if parts == ["decoder"]:
        assert (len(calls_4), len(calls_12)) == (4, 12)
    else:
        assert len(calls_4) == len(calls_12) > 0


def test_a_bad_compile_regions_is_one_error_naming_the_key():
    for bad in ("[decoder,gru]", "decoder"):
        settings = config("runtime.compile=true", f"runtime.compile_regions={bad}").runtime
        with pytest.raises(ValueError, match=r"runtime.compile_regions=.*: expected a list of image_encoders, "):
            compile_network(build_backbone(), settings)


def test_a_bad_compile_regions_is_refused_also_with_compile_off(capsys):
    """`runtime.compile_regions=[decodr]` without runtime.compile trained uncompiled, the typo unseen."""
    with pytest.raises(SystemExit) as exit_info:  # as run.py reports it, before any work
        run_task(config("task=eval", "eval=synthetic", "runtime.compile_regions=[decodr]"))
    assert exit_info.value.code == 1
    assert "error (ValueError): runtime.compile_regions=['decodr']: expected a list of" in capsys.readouterr().err


def test_cuda_graphs_graph_the_decoder_iteration_alone():
    """Inductor's modes with CUDA graphs graph the decoder's iteration only: the other regions get the mode's
    other options (graphed regions feeding each other fail under torch's CUDA graph trees)."""
    assert region_compile_settings("inductor", "default") == ({"mode": "default"}, False)
    assert region_compile_settings("inductor", "reduce-overhead") == ({"options": {}}, True)
    settings, cuda_graphs = region_compile_settings("inductor", "max-autotune")
    assert cuda_graphs and settings["options"]["max_autotune"] and "triton.cudagraphs" not in settings["options"]
    assert region_compile_settings("aot_eager", "reduce-overhead") == ({"mode": "reduce-overhead"}, False)
    with pytest.raises(ValueError, match="runtime.compile_mode='fast'"):
        region_compile_settings("inductor", "fast")


def test_a_compiled_iteration_with_its_own_outputs_gives_the_uncompiled_flow_and_gradients():
    """compile_iteration(own_outputs=True), as CUDA graphs run it: every iteration's outputs copied out of what
    the compiled graph returns; the flow of every iteration and the gradients are the uncompiled ones."""
    torch.manual_seed(0)
    net, reference = build_backbone(), build_backbone()
    reference.load_state_dict(net.state_dict())
    net.memory_decoder.compile_iteration(backend="call_recording_eager", mode="default", own_outputs=True)
    images = [torch.rand(1, 3, 64, 96) * 255 for _ in range(2)]
    CALLED_GRAPHS.clear()
    predictions = [model(*images, iters=3)["flow_predictions"] for model in (net, reference)]
    assert len(CALLED_GRAPHS) == 3  # each iteration ran compiled
    torch.testing.assert_close(predictions[0], predictions[1])
    for flows, model in zip(predictions, (net, reference)):
        sum(flow.abs().mean() for flow in flows).backward()
    for (name, parameter), expected in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, expected.grad, msg=name)


def test_a_compiled_training_step_with_recomputed_iterations_gives_the_uncompiled_gradients():
    """backbone.activation_checkpoint=[decoder] under compile: each compiled iteration is recomputed in backward."""
    torch.manual_seed(0)
    net, reference = (build_backbone(activation_checkpoint=["decoder"]) for _ in range(2))
    reference.load_state_dict(net.state_dict())
    compile_network(net, config("runtime.compile=true", "runtime.compile_backend=aot_eager").runtime)
    images = [torch.rand(1, 3, 64, 96) * 255 for _ in range(2)]
    for model in (net, reference):
        sum(flow.abs().mean() for flow in model(*images, iters=3)["flow_predictions"]).backward()
    for (name, parameter), expected in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, expected.grad, msg=name)


def test_a_compiled_training_step_gives_the_uncompiled_loss_and_gradients():
    torch.manual_seed(0)
    net, reference = build_backbone(), build_backbone()
    reference.load_state_dict(net.state_dict())
    compile_network(net, config("runtime.compile=true", "runtime.compile_backend=aot_eager").runtime)
    images = [torch.rand(1, 3, 64, 96) * 255 for _ in range(2)]
    losses = []
    for model in (net, reference):
        loss = sum(flow.abs().mean() for flow in model(*images, iters=3)["flow_predictions"])
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    for (name, parameter), expected in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, expected.grad, msg=name)


def test_a_bad_compile_mode_is_one_error_naming_the_key(tmp_path):
    result = run_py(
        "task=eval", "eval=synthetic", "backbone=tiny", "runtime.compile=true", "runtime.compile_mode=fast",
        f"hydra.run.dir={tmp_path / 'run'}", expect_ok=False, timeout=300, cwd=fresh_checkout(tmp_path / "checkout"),
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error (ValueError): runtime.compile_mode='fast': expected one of inductor's modes")


def test_two_process_ddp_training_under_compile(tmp_path):
    """trainer=ddp on CPU (gloo) with runtime.compile=true, run from a fresh checkout: trains, nothing breaks a
    graph (TORCH_LOGS=graph_breaks), plain checkpoint keys."""
    run_dir = tmp_path / "run"
    result = run_py(
        "debug=tiny", "trainer=ddp", "trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.devices=2",
        "trainer.max_steps=2", "trainer.limit_val_batches=0", "data.batch_size=1", "runtime.compile=true",
        "runtime.compile_backend=aot_eager", f"hydra.run.dir={run_dir}",
        env={"OMP_NUM_THREADS": "1", "TORCH_LOGS": "graph_breaks"}, timeout=600,
        cwd=fresh_checkout(tmp_path / "checkout"),
    )
    output = result.stdout + result.stderr
    assert "MEMBER: 2/2" in output and "torch.compile aot_eager (mode default)" in output
    assert "Graph break" not in output
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert sorted(state) == sorted(f"backbone.{key}" for key in build_backbone().state_dict())


def test_training_with_compile_saves_plain_checkpoint_keys(tmp_path):
    cfg = config(
        "debug=tiny", "trainer.max_steps=1", "model.train_iters=1", f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path}", "runtime.compile=true", "runtime.compile_backend=recording_eager",
    )
    COMPILED_GRAPHS.clear()
    fit(cfg)
    assert COMPILED_GRAPHS  # the training step ran the compiled stages
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert not [key for key in state if "_orig_mod" in key]
    assert sorted(state) == sorted(f"backbone.{key}" for key in build_backbone().state_dict())


def test_bench_reports_the_compile_time_of_each_row(tmp_path):
    cfg = config(
        "bench.device=cpu", "bench.sizes=[[64,96]]", "bench.iters=1", "bench.warmup=1", "bench.repeats=1",
        "runtime.compile=true", "runtime.compile_backend=eager", f"paths.output_dir={tmp_path}",
    )
    bench.run(cfg)
    report = json.loads((tmp_path / "bench.json").read_text())
    (row,) = report["rows"]
    assert row["status"] == "ok" and row["compile_s"] > 0  # dynamo traced the stages in the first step
    assert report["setup"]["compile"] == "eager (default) of image_encoders, cost_encoder, decoder"
    assert report["setup"]["matmul_precision"] == "high"
    header, _, line = (tmp_path / "bench.md").read_text().splitlines()
    assert "| seconds per step | pairs per second | compile s |" in header and line.count("|") == header.count("|")
    with pytest.raises(ValueError, match="runtime.compile=true needs bench.warmup >= 1"):
        bench.run(config("runtime.compile=true", "bench.warmup=0", f"paths.output_dir={tmp_path}"))
