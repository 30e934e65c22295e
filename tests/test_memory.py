"""fusedoff.memory: predictions against the tensors the setups really create, phase bookkeeping,
the table, and (on a GPU) measured against predicted."""

from __future__ import annotations

import pytest
import torch

import fusedoff
from fusedoff import memory
from fusedoff.demo import UpcastMixedPrecision
from fusedoff.kernels.reference import ApolloReference
from tests.helpers import make_params
from tests.optional_packages import require

# Odd sizes: a 0-d tensor and lengths that are not multiples of the host store's 16-element alignment
# (nor of the 256 elements of an 8-bit scale block).
SHAPES = ((), (1,), (7,), (4097,), (33, 5))
# Each optimizer with every state precision it takes (Apollo keeps fp32 states only).
KINDS = [("adamw", "fp32"), ("adamw", "bf16"), ("adamw", "8bit"), ("apollo", "fp32")]
KIND_IDS = [f"{kind}-{precision}" for kind, precision in KINDS]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def make_optimizer(kind, precision, params, **options):
    if kind == "apollo":
        return fusedoff.Apollo(params, lr=0.01, **options)
    return fusedoff.AdamW(params, state_precision=precision, **options)


def state_tensors(opt, keep) -> list[torch.Tensor]:
    """The optimizer's state tensors whose key passes `keep` (step counters are never predicted)."""
    return [t for s in opt.state.values() for k, t in s.items() if isinstance(t, torch.Tensor) and k != "step" and keep(k)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,precision", KINDS, ids=KIND_IDS)
def test_fusedoff_without_offload_predicts_the_states_and_masters_it_creates(kind, precision, dtype):
    params = make_params(SHAPES, dtype, grads=True)
    opt = make_optimizer(kind, precision, params, offload="none")
    opt.step()
    got = memory.predict(params, optimizer=kind, offload="none", state_precision=precision)
    assert got.device[memory.PARAMETERS] == nbytes(params)
    assert got.device[memory.GRADIENTS] == nbytes(p.grad for p in params)
    assert got.device[memory.STATES] == nbytes(state_tensors(opt, lambda k: k != "master_param"))
    assert got.device[memory.MASTERS] == nbytes(state_tensors(opt, lambda k: k == "master_param"))
    assert got.device[memory.MASTERS] == (4 * sum(p.numel() for p in params) if dtype == torch.bfloat16 else 0)
    assert got.device[memory.FP32_GRADS] == got.device[memory.BUFFERS] == got.host_total == 0
    assert memory.check_memory_stats(got, opt.memory_stats()) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,precision", KINDS, ids=KIND_IDS)
def test_streamed_fusedoff_predicts_its_host_store_and_buffers(kind, precision, dtype):
    # With CPU parameters offload="stream" runs the same store and buffer rotation as on a GPU.
    params = make_params(SHAPES, dtype, grads=True)
    chunk = 256  # several chunks, tensors spanning them
    options = dict(offload="stream", chunk_size=chunk, num_buffers=3)
    opt = make_optimizer(kind, precision, params, **options)
    opt.step()
    got = memory.predict(params, optimizer=kind, state_precision=precision, **options)
    stats = opt.memory_stats()
    assert got.host_total == stats["host_bytes"]
    assert memory.check_memory_stats(got, stats) == []
    slabs = [(name, slab) for layout in opt._engine.buckets.values() for name, ss in layout.store.slabs.items()
             for slab in ss]
    assert got.host[memory.HOST_MASTERS] == nbytes(slab for name, slab in slabs if name == "master_param")
    assert got.host[memory.HOST_STATES] == nbytes(slab for name, slab in slabs if name != "master_param")
    assert got.host[memory.HOST_MASTERS] > 0 if dtype == torch.bfloat16 else got.host[memory.HOST_MASTERS] == 0
    buffers = [buffer_set for pipeline in opt._engine.pipelines.values() for buffer_set in pipeline.buffers]
    assert len(buffers) == 3 and got.device[memory.BUFFERS] == nbytes(buffers)
    assert got.device[memory.STATES] == got.device[memory.MASTERS] == 0
    # Per parameter: the slabs' bytes over every element (all stream), and each way what the step counted.
    elements = sum(p.numel() for p in params)
    assert got.streamed_params == stats["streamed_params"] == elements
    assert got.host_bytes_per_param == stats["host_bytes_per_param"] == nbytes(slab for _, slab in slabs) / elements
    assert got.link == stats["link_bytes_last_step"] and got.link["to_device"] > 0
    assert got.link_bytes_per_param == stats["link_bytes_per_param_last_step"]


@pytest.mark.parametrize("master_precision", ["split", "split8"])
@pytest.mark.parametrize("offload", ["none", "stream"])
@pytest.mark.parametrize("kind,precision", [("adamw", "fp32"), ("adamw", "8bit"), ("apollo", "fp32")])
def test_split_masters_are_predicted_as_the_optimizer_keeps_them(kind, precision, offload, master_precision):
    """A split master's low bits (2 or 1 bytes per element) on the device or in the host store: the
    prediction against the tensors and slabs the optimizer holds and the bytes its step counted."""
    params = make_params(SHAPES, torch.bfloat16, grads=True)
    options = dict(offload=offload, master_precision=master_precision) | (
        dict(chunk_size=256) if offload == "stream" else {})
    opt = make_optimizer(kind, precision, params, **options)
    opt.step()
    got = memory.predict(params, optimizer=kind, state_precision=precision, **options)
    assert memory.check_memory_stats(got, opt.memory_stats()) == []
    per_element = {"split": 2, "split8": 1}[master_precision] * sum(p.numel() for p in params)
    if offload == "none":
        assert got.device[memory.MASTERS] == nbytes(state_tensors(opt, lambda k: k.startswith("master_low"))) == per_element
        return
    slabs = [slab for layout in opt._engine.buckets.values() for name, ss in layout.store.slabs.items()
             for slab in ss if name.startswith("master_low")]
    assert got.host[memory.HOST_MASTERS] == nbytes(slabs) >= per_element
    assert got.link == opt.memory_stats()["link_bytes_last_step"]


def test_check_memory_stats_reports_a_difference():
    params = make_params(SHAPES, torch.float32, grads=True)
    opt = fusedoff.AdamW(params, offload="stream", chunk_size=256)
    opt.step()
    amsgrad = memory.predict(params, offload="stream", chunk_size=256, amsgrad=True)  # one state too many
    problems = memory.check_memory_stats(amsgrad, opt.memory_stats())
    # A third state in the host store, in every buffer set, and moved each way at every step.
    assert [p.split()[0] for p in problems] == ["host_bytes", "device_bytes", "link_bytes_last_step"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,precision", KINDS, ids=KIND_IDS)
def test_a_device_budget_splits_the_prediction_as_the_optimizer_places_states(kind, precision, dtype):
    params = make_params(SHAPES, dtype, grads=True)
    # The first tensor (one element) by hand: its states (8-bit: a code and a block scale for each
    # moment) and master; then only what fits the rest.
    first = {"fp32": 3 * 4 if kind == "apollo" else 2 * 4, "bf16": 2 * 2, "8bit": 2 * (1 + 4)}[precision]
    budget = first + (4 if dtype == torch.bfloat16 else 0) + 100
    options = dict(offload="stream", chunk_size=64, device_budget=budget)
    opt = make_optimizer(kind, precision, params, **options)
    opt.step()
    got = memory.predict(params, optimizer=kind, state_precision=precision, **options)
    stats = opt.memory_stats()
    assert memory.check_memory_stats(got, stats) == []
    assert 0 < stats["resident_bytes"] <= budget and stats["streamed_bytes"] > 0
    # Resident states are tensors of opt.state on the parameters' device, counted by hand here.
    by_hand = sum(v.numel() * v.element_size() for p in params for k, v in opt.state[p].items()
                  if k != "step" and not any(v.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()
                                             for layout in opt._engine.buckets.values() if layout.store is not None
                                             for slabs in layout.store.slabs.values() for slab in slabs))
    assert stats["resident_bytes"] == by_hand
    streamed = [p for p in params if any(opt.state[p]["exp_avg" if kind != "apollo" else "update"].untyped_storage()
                                         .data_ptr() == slab.untyped_storage().data_ptr()
                                         for layout in opt._engine.buckets.values() if layout.store is not None
                                         for slab in layout.store.slabs["exp_avg" if kind != "apollo" else "update"])]
    assert 0 < len(streamed) < len(params)
    assert got.streamed_params == stats["streamed_params"] == sum(p.numel() for p in streamed)
    assert got.host_bytes_per_param == stats["host_bytes_per_param"] == stats["host_bytes"] / got.streamed_params
    assert got.link == stats["link_bytes_last_step"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("apollo", [dict(weight_decay=0.01, rebound="constant", weight_decay_type="L2"),
                                    dict(weight_decay=0.01, rebound="belief", weight_decay_type="stable"),
                                    dict()], ids=["constant-L2", "belief-stable", "defaults"])
def test_apollo_prediction_moves_what_its_phases_declare(apollo, dtype):
    """Apollo's streamed step moves, per phase, the states that phase declares: the prediction asks the
    class for its phases under `options`, and agrees with the copies the step counted, tensors spanning
    chunks (a pass per phase) and chunks of whole tensors (one pass) alike."""
    params = make_params(SHAPES, dtype, grads=True)
    options = dict(offload="stream", chunk_size=64)
    opt = fusedoff.Apollo(params, lr=0.01, **apollo, **options)
    opt.step()
    got = memory.predict(params, optimizer="apollo", options=apollo, **options)
    stats = opt.memory_stats()
    assert memory.check_memory_stats(got, stats) == []
    assert got.link == stats["link_bytes_last_step"]
    # More comes in than goes out: the reduce phase copies the states in and nothing back.
    assert got.link["to_device"] > got.link["to_host"] > 0


def test_check_memory_stats_reports_link_bytes_that_differ():
    params = make_params(SHAPES, torch.bfloat16, grads=True)
    options = dict(offload="stream", chunk_size=64)
    opt = fusedoff.Apollo(params, lr=0.01, weight_decay=0.01, rebound="belief", weight_decay_type="stable", **options)
    opt.step()
    defaults = memory.predict(params, optimizer="apollo", **options)  # no decay: other phases, fewer bytes
    assert [p.split()[0] for p in memory.check_memory_stats(defaults, opt.memory_stats())] == ["link_bytes_last_step"]


def test_streamed_8bit_states_by_hand_two_buckets_share_the_largest_buffer_set():
    # An fp32 bucket (7 and 300 elements) and a bf16 one with fp32 masters (1000 elements).
    params = [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n, dtype in
              ((7, torch.float32), (300, torch.float32), (1000, torch.bfloat16))]
    for p in params:
        p.grad = torch.randn_like(p)
    options = dict(offload="stream", chunk_size=100)  # 112 (16-aligned), then 256: whole 8-bit blocks
    opt = fusedoff.AdamW(params, state_precision="8bit", **options)
    opt.step()
    got = memory.predict(params, state_precision="8bit", **options)
    assert memory.check_memory_stats(got, opt.memory_stats()) == []
    # Each tensor starts on a multiple of 256 elements: 7 -> 256, 300 -> 512, 1000 -> 1024. Per element
    # one byte of each moment, per 256 one fp32 scale of each.
    fp32_bucket = 2 * (256 + 512) + 2 * 4 * 3
    bf16_bucket = 2 * 1024 + 2 * 4 * 4
    assert got.host[memory.HOST_STATES] == fp32_bucket + bf16_bucket
    assert got.host[memory.HOST_MASTERS] == 4 * 1024
    # A buffer set holds a chunk of 256 elements of each state, each region rounded up to 64 bytes:
    # codes 256 + 256, scales 64 + 64, and the bf16 bucket's master 1024. Two sets of the larger.
    assert got.device[memory.BUFFERS] == 2 * (256 + 256 + 64 + 64 + 1024)
    assert got.device[memory.STATES] == got.device[memory.MASTERS] == 0


def test_compressed_states_predicted_from_shapes_alone():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096)).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())  # every tensor a multiple of 256 elements: no padding
    chunk = fusedoff.offload.engine.DEFAULT_CHUNK_SIZE
    eight = memory.predict(model, offload="stream", device="cuda", state_precision="8bit")
    assert eight.host[memory.HOST_STATES] == 2 * n + 2 * 4 * n // 256 and eight.host[memory.HOST_MASTERS] == 4 * n
    assert eight.device[memory.BUFFERS] == 2 * (2 * chunk + 2 * 4 * chunk // 256 + 4 * chunk)
    bf16 = memory.predict(model, offload="stream", device="cuda", state_precision="bf16")
    assert bf16.host[memory.HOST_STATES] == 2 * 2 * n and bf16.device[memory.BUFFERS] == 2 * (2 + 2 + 4) * chunk
    resident = memory.predict(model, offload="none", device="cuda", state_precision="8bit")
    assert resident.device[memory.STATES] == 2 * n + 2 * 4 * n // 256 and resident.host_total == 0


def test_state_precision_refused_where_the_setup_does_not_take_it():
    params = make_params(SHAPES, torch.bfloat16, grads=True)
    for setup in ("plain", "upcast"):
        with pytest.raises(ValueError, match="state_precision='8bit' is a fusedoff option"):
            memory.predict(params, setup=setup, state_precision="8bit")
    with pytest.raises(ValueError, match="Apollo keeps fp32 states only"):
        memory.predict(params, optimizer="apollo", state_precision="bf16")
    with pytest.raises(ValueError, match="amsgrad"):  # as fusedoff.AdamW refuses it
        memory.predict(params, amsgrad=True, state_precision="8bit")
    with pytest.raises(ValueError, match="state_precision must be one of"):
        memory.predict(params, state_precision="int4")


@pytest.mark.parametrize("kind,precision", KINDS, ids=KIND_IDS)
def test_state_specs_and_phases_are_the_optimizers_own(kind, precision):
    """The public names the cost model reads (memory.state_specs_of, memory.phases_of) give what a real
    optimizer keeps and declares."""
    param = torch.nn.Parameter(torch.randn(300))
    param.grad = torch.randn(300)
    opt = make_optimizer(kind, precision, [param])
    opt.step()
    specs = memory.state_specs_of(kind, precision)
    assert {s.name for s in specs} == set(opt.state[param]) - {"step"}
    names = tuple(s.name for s in specs)
    group = opt.param_groups[0]
    assert memory.phases_of(kind, precision)(names) == type(opt)._phases(group, names)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        memory.state_specs_of("sgd")


def test_the_label_and_the_table_say_a_compressed_precision():
    params = make_params(((1024, 1024),), torch.bfloat16, grads=True)
    eight = memory.predict(params, offload="stream", device="cuda", state_precision="8bit")
    upcast = memory.predict(params, setup="upcast")
    assert (eight.label, eight.state_precision, upcast.state_precision) == ("fusedoff stream 8bit", "8bit", None)
    lines = memory.format_report([eight, upcast]).splitlines()
    assert lines[1].split()[-2:] == ["8bit", "-"] and lines[1].startswith("  fusedoff state precision")
    fp32 = memory.predict(params, offload="stream", device="cuda")
    assert fp32.label == "fusedoff stream" and "precision" not in memory.format_report([fp32, upcast])


@pytest.mark.parametrize("kind", ["adamw", "apollo"])
def test_plain_setup_predicts_the_states_of_torch_and_the_reference_on_bf16_parameters(kind):
    params = make_params(SHAPES, torch.bfloat16, grads=True)
    opt = ApolloReference(params, lr=0.01) if kind == "apollo" else torch.optim.AdamW(params, fused=True)
    opt.step()
    got = memory.predict(params, setup="plain", optimizer=kind)
    assert got.device[memory.STATES] == nbytes(state_tensors(opt, lambda k: True))
    assert got.device[memory.MASTERS] == got.device[memory.FP32_GRADS] == got.host_total == 0


def test_upcast_setup_predicts_masters_fp32_gradient_copies_and_fp32_states():
    params = make_params(SHAPES, torch.bfloat16, grads=True)
    opt = UpcastMixedPrecision(params, lambda masters: torch.optim.AdamW(masters, fused=True))
    opt.step()
    got = memory.predict(params, setup="upcast")
    assert got.device[memory.MASTERS] == nbytes(opt.masters)
    assert got.device[memory.FP32_GRADS] == nbytes(m.grad for m in opt.masters)
    assert got.device[memory.STATES] == nbytes(state_tensors(opt.optimizer, lambda k: True))
    assert got.device[memory.PARAMETERS] == got.device[memory.GRADIENTS] == nbytes(params)
    # fusedoff on the same parameters: no fp32 gradient copy, and streamed, no state on the device.
    ours = memory.predict(params, offload="stream", chunk_size=256, device="cuda")
    assert ours.device[memory.FP32_GRADS] == ours.device[memory.STATES] == ours.device[memory.MASTERS] == 0


def test_predictions_need_only_shapes_and_dtypes():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096)).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    got = memory.predict(model, offload="stream", device="cuda")
    assert got.device[memory.PARAMETERS] == got.device[memory.GRADIENTS] == 2 * n
    assert got.device[memory.BUFFERS] == 2 * 3 * fusedoff.offload.engine.DEFAULT_CHUNK_SIZE * 4
    assert got.host[memory.HOST_STATES] == 2 * 4 * n and got.host[memory.HOST_MASTERS] == 4 * n  # sizes align
    # No gradient in the forward pass (zero_grad(set_to_none=True) comes first), all of them after it.
    assert got.present("forward") == 2 * n + got.device[memory.BUFFERS]
    assert got.present("backward") == got.present("step") == got.device_total == 4 * n + got.device[memory.BUFFERS]
    upcast = memory.predict(model, setup="upcast")  # its fp32 gradient copies exist in the step only
    assert upcast.present("step") - upcast.present("backward") == upcast.device[memory.FP32_GRADS] == 4 * n


def test_tied_parameters_count_once_and_bad_arguments_are_refused():
    shared = torch.nn.Parameter(torch.zeros(10))
    assert memory.predict([shared, shared]).device[memory.PARAMETERS] == 40
    with pytest.raises(ValueError, match="setup"):
        memory.predict([shared], setup="deepspeed")
    with pytest.raises(ValueError, match="amsgrad"):
        memory.predict([shared], optimizer="apollo", amsgrad=True)
    with pytest.raises(ValueError, match="phase"):
        memory.predict([shared]).present("optimizer")


def test_cpu_phases_record_calls_and_a_transient_peak():
    report = memory.MemoryReport("cpu")
    if not report.host_peak_resettable:
        pytest.skip("this kernel does not let the peak resident memory be reset")
    for _ in range(2):
        with report.phase("forward"):
            transient = torch.ones(16 * 2**20)  # 64 MiB, touched, freed before the phase ends
            del transient
        with report.phase("step"):
            pass
    forward, step = report.phases["forward"], report.phases["step"]
    assert list(report.phases) == ["forward", "step"] and forward.calls == step.calls == 2
    # Linux counts resident pages per thread in batches, so RSS may lag by up to 64 pages a thread.
    assert forward.peak_bytes - forward.entry_bytes >= 63 * 2**20
    assert step.peak_bytes - step.entry_bytes < 2**20


class FakeCudaCounters:
    """torch.cuda's allocator counters, driven by the test (no GPU touched)."""

    def __init__(self):
        self.allocated = self.peak = 0

    def allocate(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def reset_peak(self, device=None):
        self.peak = self.allocated

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset_peak)


def test_cuda_phases_reset_and_read_the_peak_counter(monkeypatch):
    counters = FakeCudaCounters()
    counters.install(monkeypatch)
    counters.allocate(1000)
    report = memory.MemoryReport("cuda:0")
    counters.allocate(5000)  # a peak before the phase is not the phase's
    counters.allocate(-5000)
    with report.phase("forward"):
        counters.allocate(300)
        counters.allocate(-100)
    assert (report.phases["forward"].entry_bytes, report.phases["forward"].peak_bytes) == (0, 300)
    with report.phase("backward"):  # enters at 200
        counters.allocate(700)
        counters.allocate(-800)
        counters.reset_peak()  # someone else resets the process-wide counter, below the entry level
        counters.allocate(50)
    backward = report.phases["backward"]
    # The peak before the reset (900) is lost; the entry reading bounds it below, and it is flagged.
    assert backward.counter_reset_seen and backward.peak_bytes == 200
    with report.phase("step"):  # a reset above the entry level loses nothing here and is not flagged
        counters.allocate(400)
        counters.reset_peak()
        counters.allocate(-400)
    assert not report.phases["step"].counter_reset_seen and report.phases["step"].peak_bytes == 150 + 400
    assert "reset elsewhere" in memory.format_report([], [memory.MeasuredRun("run", memory.predict([]), report)])


def test_table_shows_every_component_and_the_remainder_of_each_phase():
    params = make_params(((1024, 1024),), torch.bfloat16, grads=True)  # 2 MiB of bf16
    ours = memory.predict(params, offload="stream", chunk_size=2**17, device="cuda", label="fusedoff stream")
    upcast = memory.predict(params, setup="upcast", label="torch + upcast")
    report = memory.MemoryReport("cpu")
    report.phases["forward"] = memory.PhaseMemory("forward", calls=1, entry_bytes=0, peak_bytes=10 * 2**20)
    report.phases["custom"] = memory.PhaseMemory("custom", calls=1, entry_bytes=0, peak_bytes=2**20)
    run = memory.MeasuredRun("fusedoff.AdamW", ours, report, notes=["a note"])
    table = memory.format_report([ours, upcast], [run])
    lines = table.splitlines()
    assert lines[0].split()[-4:] == ["stream", "torch", "+", "upcast"]

    def row(name):
        return next(line for line in lines if line.startswith("  " + name)).split()[-2:]

    assert row(memory.PARAMETERS) == ["2.00", "2.00"]
    assert row(memory.STATES) == ["0.00", "8.00"]
    assert row(memory.MASTERS) == ["0.00", "4.00"]
    assert row(memory.FP32_GRADS) == ["0.00", "4.00"]
    assert row(memory.BUFFERS) == ["3.00", "0.00"]  # 2 sets x 3 states x 2**17 x 4 bytes
    assert row("device total at the step") == ["7.00", "20.00"]
    assert row(memory.HOST_STATES) == ["8.00", "0.00"]
    assert row(memory.HOST_MASTERS) == ["4.00", "0.00"]
    forward = next(line for line in lines if " forward " in line).split()
    # predicted in the forward pass: parameters and buffers (5 MiB); peak 10 MiB; remainder 5 MiB
    assert forward[-4:] == ["5.00", "0.00", "10.00", "5.00"]
    custom = next(line for line in lines if " custom " in line).split()
    assert custom[-4:] == ["-", "0.00", "1.00", "-"]  # no prediction for a phase it does not know
    assert "  a note" in lines


def test_plot_writes_a_png(tmp_path):
    require("matplotlib")
    params = make_params(SHAPES, torch.float32, grads=True)
    report = memory.MemoryReport("cpu")
    with report.phase("forward"):
        pass
    path = tmp_path / "memory.png"
    memory.plot_report([memory.MeasuredRun("run", memory.predict(params), report)], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.cuda
@pytest.mark.parametrize("setup", ["fusedoff", "fusedoff-8bit", "upcast"])
def test_cuda_measured_step_matches_the_prediction(setup):
    # Sizes in multiples of 512 bytes: the caching allocator rounds every block up to 512 bytes.
    shapes = [(2**20,)] * 4 + [(512, 1024)]
    torch.cuda.synchronize()
    report = memory.MemoryReport("cuda")
    params = make_params(shapes, torch.bfloat16, device="cuda", grads=True)
    for p in params:
        p.grad = None
    chunk = 2**18
    if setup == "fusedoff":
        opt = fusedoff.AdamW(params, offload="stream", chunk_size=chunk)
        predicted = memory.predict(params, offload="stream", chunk_size=chunk)
    elif setup == "fusedoff-8bit":  # the first tensor's codes, scales and master resident (6 MiB + 32 KiB)
        options = dict(offload="stream", chunk_size=chunk, device_budget=7 * 2**20, state_precision="8bit")
        opt = fusedoff.AdamW(params, **options)
        predicted = memory.predict(params, **options)
        assert 0 < predicted.device[memory.STATES] < predicted.host[memory.HOST_STATES]
    else:
        opt = UpcastMixedPrecision(params, lambda masters: torch.optim.AdamW(masters, fused=True))
        predicted = memory.predict(params, setup="upcast")
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        with report.phase("forward"):
            pass
        with report.phase("backward"):
            for p in params:
                p.grad = torch.randn_like(p)
        with report.phase("step"):
            opt.step()
    torch.cuda.synchronize()
    # Besides the predicted components: one step counter per tensor (a 512-byte block each) and,
    # for torch, its fused kernel's small bookkeeping tensors.
    slack = 64 * 1024
    for name in ("forward", "backward", "step"):
        phase = report.phases[name]
        assert 0 <= phase.peak_bytes - predicted.present(name) <= slack, (name, phase, predicted)
    if setup != "upcast":
        assert memory.check_memory_stats(predicted, opt.memory_stats()) == []
