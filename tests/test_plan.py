"""`rewardax plan` compiles the real train step for TPU slices on this CPU machine (libtpu from
`make test`, in .venv/libtpu beside the venv) and reports what one chip holds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rewardax.config import RewardConfig
from rewardax.plan import GIB, alternatives

# Left out of `make test`, run by `make test-slow`: compiles train steps for TPU slices with libtpu.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RX = Path(sys.executable).parent / "rewardax"
LIBTPU = Path(os.environ.get("REWARDAX_LIBTPU_DIR", ROOT / ".venv" / "libtpu"))
ARCH = {  # a small llama: 4 layers of 256, a 4096-token vocabulary
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
# Parameters: embedding + per layer (q, k, v, o, gate, up, down, 2 norms) + final norm + head.
H, MLP, L, V, KV = 256, 512, 4, 4096, 2 * 64
PARAMS = V * H + L * (H * H + 2 * H * KV + H * H + 3 * H * MLP + 2 * H) + H + H


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("shape")
    (d / "config.json").write_text(json.dumps(ARCH))
    return d


def run_plan(
    *args: str, libtpu: bool = True, prelude: str = "", hlo_dir: Path | None = None
) -> subprocess.CompletedProcess:
    """`rewardax plan ARGS`; ``prelude``: Python run first in the same process (a test's patch);
    ``hlo_dir``: where XLA writes the compiled programs' HLO text."""
    if libtpu and not (LIBTPU / "libtpu").is_dir():
        pytest.fail(f"libtpu is not in {LIBTPU}: `make test` installs it (requirements-tpu.lock)")
    env = {"JAX_PLATFORMS": "cpu", "PATH": str(RX.parent)}
    if hlo_dir is not None:
        env["XLA_FLAGS"] = f"--xla_dump_to={hlo_dir} --xla_dump_hlo_as_text"
    if libtpu:
        env["PYTHONPATH"] = str(LIBTPU)
    command = [str(RX), "plan", *args]
    if prelude:
        main = "import sys\nfrom rewardax.cli import main\nsys.exit(main(sys.argv[1:]))"
        command = [sys.executable, "-c", f"{prelude}\n{main}", "plan", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_state_is_split_over_the_chips_of_a_slice_by_fsdp(shape_dir):
    common = [
        "--topology=v5e:2x4",
        f"--model.path={shape_dir}",
        "--data.max_sequence_length=256",
        "--train.per_device_train_batch_size=1",
        "--data.layout=padded",
    ]
    replicated = summary(run_plan(*common, "--mesh.dp=-1", "--mesh.fsdp=1"))
    split = summary(run_plan(*common, "--mesh.dp=1", "--mesh.fsdp=-1"))
    assert replicated["devices"] == split["devices"] == 8
    assert replicated["processes"] == 1  # a v5e host drives 2x4 chips
    assert replicated["device_kind"] == "TPU v5 lite" and replicated["hbm_limit_gib"] == 15.75
    assert replicated["mesh"] == {"dp": 8, "fsdp": 1, "tp": 1}
    assert split["mesh"] == {"dp": 1, "fsdp": 8, "tp": 1}
    assert replicated["parameters"] == split["parameters"] == PARAMS
    assert replicated["pairs_per_step"] == 8 and replicated["tokens_per_step"] == 8 * 2 * 256
    # Arguments per chip: float32 parameters and AdamW's two moments (3 x 4 bytes each), whole
    # on every chip or an eighth of them, plus the same small batch shard (and scalars).
    state = 3 * 4 * PARAMS
    batch_and_scalars = replicated["hbm_bytes"]["arguments"] - state
    assert 0 <= batch_and_scalars < 64 * 1024, batch_and_scalars
    split_state = split["hbm_bytes"]["arguments"] - batch_and_scalars
    # An eighth, and a little more: replicated norm scales, and shards whose small minor
    # dimensions the TPU pads to its (8, 128) tiles (k/v's 2 heads of 64 per chip here).
    assert state / 8 <= split_state < state / 6, (split_state, state / 8)
    for s in (replicated, split):
        assert s["fits"] is True and s["suggestions"] == []
        h = s["hbm_bytes"]
        total = h["arguments"] + h["outputs"] - h["aliased"] + h["temporaries"]
        assert total == h["total"] and abs(total / GIB - s["hbm_per_chip_gib"]) < 0.001
        assert h["aliased"] > 0  # the donated state is written in place


def too_big(shape_dir) -> list[str]:
    """One v5e chip and 128 pairs of 4096 tokens per step: without remat, more than it holds."""
    return [
        "--topology=v5e:1x1",
        f"--model.path={shape_dir}",
        "--data.layout=padded",
        "--data.max_sequence_length=4096",
        "--train.per_device_train_batch_size=128",
    ]


def test_a_job_that_does_not_fit_says_so_and_which_settings_would(shape_dir):
    proc = run_plan(
        *too_big(shape_dir),
        "--model.remat_policy=none",
        # float32 compute (bf16 is `auto`'s choice for a TPU): with bf16 activations libtpu's
        # estimate for offloaded moments came out above the job's own.
        "--model.dtype=float32",
    )
    s = summary(proc)
    assert s["fits"] is False and s["hbm_per_chip_gib"] > s["hbm_limit_gib"]
    assert "does NOT fit" in proc.stdout
    tried = {tuple(x["settings"]): x for x in s["suggestions"]}
    assert ("model.remat_policy=full",) in tried
    halved = (
        "train.per_device_train_batch_size=64",
        "train.gradient_accumulation_steps=2",
    )
    assert halved in tried
    for x in s["suggestions"]:  # each lowers the memory, and says whether it now fits
        assert x["hbm_per_chip_gib"] < s["hbm_per_chip_gib"], x
        assert x["fits"] == (x["hbm_per_chip_gib"] <= s["hbm_limit_gib"])
    # remat keeps one layer's activations instead of four: far less than the job's.
    assert tried[("model.remat_policy=full",)]["hbm_per_chip_gib"] < 0.6 * s["hbm_per_chip_gib"]


def test_auto_settings_are_decided_for_the_slice_and_reported(shape_dir):
    """model.dtype and model.remat_policy left at `auto`: bf16 compute for a TPU, and the first
    remat policy (save_attention_mlp, save_attention, full) whose step fits the chip less its headroom (an
    accumulation of its own: `auto` does not split the pairs further, one compile per policy)."""
    proc = run_plan(*too_big(shape_dir), "--train.gradient_accumulation_steps=2")
    s = summary(proc)
    assert s["resolved"]["model.dtype"] == "bfloat16"
    tried = [
        (name, float(gib.removesuffix(" GiB")))
        for name, gib in (x.split(": ") for x in s["remat_tried"])
    ]
    names = [name for name, _ in tried]
    assert names == ["save_attention_mlp", "save_attention", "full"][: len(names)]
    limit = s["hbm_limit_gib"] - 0.125
    assert tried[0][1] > limit  # save_attention_mlp does not fit this job
    chosen = s["resolved"]["model.remat_policy"]
    assert chosen == names[-1] and (tried[-1][1] <= limit or chosen == "full")
    assert all(gib > limit for _, gib in tried[:-1])
    assert s["hbm_per_chip_gib"] == pytest.approx(tried[-1][1], abs=0.01)
    assert f"auto settings: model.dtype=bfloat16, model.remat_policy={chosen}" in proc.stdout


def test_bad_topologies_and_a_missing_libtpu_are_clear_errors(shape_dir):
    bad = run_plan("--topology=v9x:2x2", f"--model.path={shape_dir}")
    assert bad.returncode == 2
    assert (
        bad.stderr.strip()
        .splitlines()[-1]
        .startswith("rewardax: error: topology 'v9x:2x2': use GENERATION:XxY")
    )
    odd = run_plan("--topology=v5e:3x3", f"--model.path={shape_dir}")
    assert odd.returncode == 2
    assert "is not a TPU slice libtpu can describe" in odd.stderr
    missing = run_plan("--topology=v5e:1x1", f"--model.path={shape_dir}", libtpu=False)
    assert missing.returncode == 2
    assert "pip install 'rewardax[tpu]'" in missing.stderr
    assert "Traceback" not in bad.stderr + odd.stderr + missing.stderr


def test_alternatives_each_lower_one_thing():
    config = RewardConfig.from_dict(
        {"model": {"remat_policy": "none", "param_dtype": "float32"}, "train": {"seed": 0}}
    )
    config.train.per_device_train_batch_size = 6
    config.train.gradient_accumulation_steps = 3
    assert alternatives(config, 8) == [
        ("model.remat_policy=full",),  # faster than offload_attention, ~its memory: not both
        ("mesh.dp=1", "mesh.fsdp=-1", "mesh.tp=1"),
        ("optim.offload_state=true",),
        ("model.param_dtype=bfloat16",),
        ("model.lora_rank=16", "model.param_dtype=bfloat16"),
        ("train.per_device_train_batch_size=3", "train.gradient_accumulation_steps=6"),
    ]
    offload = ("model.remat_policy=offload_attention",)
    config.model.remat_policy = "full"
    # Padded rows run rewardax's flash kernels on a TPU, where offloading needs more memory
    # than full (test_offloaded_attention_residuals_leave_the_chip_for_host_memory) ...
    assert offload not in alternatives(config, 8)
    # ... the branch mask runs splash, where offloading keeps a little less than full's memory.
    config.data.layout = "shared_prompt"
    assert alternatives(config, 8)[0] == offload
    config.data.layout = "padded"
    config.model.kernels = "xla"  # no splash kernel, no residuals to offload
    assert offload not in alternatives(config, 8)
    config.model.dtype = "bfloat16"  # mixed precision: the master weights can leave the chip
    assert ("optim.offload_state=true", "optim.offload_params=true") in alternatives(config, 8)
    config.model.remat_policy = "offload_attention"
    config.model.param_dtype = "bfloat16"
    config.model.lora_rank = 8
    config.optim.offload_state = True
    config.train.per_device_train_batch_size = 1
    assert alternatives(config, 1) == []  # one chip: no data-parallel devices to turn into fsdp


def test_offloaded_state_and_parameters_leave_the_chip_for_host_memory(shape_dir):
    common = [
        "--topology=v5e:1x1",
        f"--model.path={shape_dir}",
        "--data.layout=padded",
        "--data.max_sequence_length=256",
        "--train.per_device_train_batch_size=1",
        "--model.dtype=bfloat16",
        "--model.param_dtype=float32",
    ]
    on_chip = summary(run_plan(*common))["hbm_bytes"]
    state = summary(run_plan(*common, "--optim.offload_state=true"))["hbm_bytes"]
    both = summary(run_plan(*common, "--optim.offload_state=true", "--optim.offload_params=true"))[
        "hbm_bytes"
    ]
    moments, params = 2 * 4 * PARAMS, 4 * PARAMS
    assert on_chip["host"] == 0
    # The moments move to the host (written in place there: counted once) ...
    assert abs(state["host"] - moments) < 0.02 * moments
    assert abs((on_chip["arguments"] - state["arguments"]) - moments) < 0.02 * moments
    # ... and with offload_params the parameters too: no argument stays on the chip.
    assert abs(both["host"] - (moments + params)) < 0.02 * (moments + params)
    assert both["arguments"] < 64 * 1024


def test_offloaded_attention_residuals_leave_the_chip_for_host_memory(tmp_path):
    """remat offload_attention: the attention kernels' residuals go to host memory, so the
    host holds what `save_attention` keeps on the chip, and the chip about what it holds with
    `full`: with splash 294.8 MB of temporaries against full's 317.4, with rewardax's flash
    kernels (a TPU's padded rows since 2026-12-08) 304.6 against 285.8 (flash's full needs
    31.6 MB less than splash's, its offload 9.8 MB more, in buffers not tied to one array):
    within one layer's residuals (25.4 MB here) of full, and so not offered by `plan`.

    The model has more layers than `transformer.UNROLLED_MAX_LAYERS`, so that every policy runs
    the layers as the same loop (offload_attention always does): with `ARCH`'s 4 layers `full`
    runs unrolled, and since RoPE's rotation is a product on the TPU path (2026-12-07) that
    needs 31% less memory than the loop (0.127 against 0.185 GiB of temporaries)."""
    from rewardax.models.transformer import UNROLLED_MAX_LAYERS

    layers = UNROLLED_MAX_LAYERS + 1
    (tmp_path / "config.json").write_text(json.dumps({**ARCH, "num_hidden_layers": layers}))
    rows, length, heads, kv_heads, head_dim = 16, 1024, 4, 2, 64
    common = [
        "--topology=v5e:1x1",
        f"--model.path={tmp_path}",
        "--data.layout=padded",
        f"--data.max_sequence_length={length}",
        f"--train.per_device_train_batch_size={rows // 2}",
        "--model.dtype=bfloat16",
    ]
    memory = {
        policy: summary(run_plan(*common, f"--model.remat_policy={policy}"))["hbm_bytes"]
        for policy in ("full", "save_attention", "offload_attention")
    }
    full, saved, offloaded = memory["full"], memory["save_attention"], memory["offload_attention"]
    # Per layer: q and the output [rows, heads, length, head_dim], k and v [rows, kv_heads, ...]
    # in bf16, the log-sum-exp in float32; up to twice that, where the 64-wide heads are laid
    # out in the TPU's 128-wide tiles (`Kernels.dense_residuals` off, the default).
    residuals = layers * rows * length * (2 * (heads + kv_heads) * head_dim * 2 + heads * 4)
    assert full["host"] == saved["host"] == 0
    assert offloaded["temporaries"] <= full["temporaries"] + residuals / layers
    assert saved["temporaries"] > full["temporaries"] + 0.5 * offloaded["host"]
    assert residuals <= offloaded["host"] <= 2.1 * residuals, (offloaded["host"], residuals)


# The embedding lookup before 2026-12-07: the table cast to bf16, then the rows (`nnx.Embed`).
BF16_LOOKUP = """
import jax.numpy as jnp
import rewardax.models.transformer
rewardax.models.transformer.embed_rows = lambda table, ids: jnp.take(
    table.astype(jnp.bfloat16), ids, axis=0
)
"""


def test_accumulated_steps_keep_no_dense_embedding_gradient_per_microbatch(tmp_path):
    """Compiled for a v5e, a step of 4 microbatches with bf16 compute: the embedding's gradient,
    summed in float32 (`transformer.embed_rows`), is scatter-added straight into the step's
    float32 sum. The lookup of a bf16-cast table summed it in bf16 into a dense [vocab, hidden]
    buffer per microbatch, converted and added after: one bf16 buffer more (64 MiB at 131072 x
    256), and on the chip 16 ms of Qwen2.5-0.5B's 926 ms step at 8 x 2048 in the add alone."""
    vocab, hidden = 131072, 256
    arch = {**ARCH, "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(arch))
    common = [
        "--topology=v5e:1x1",
        f"--model.path={tmp_path}",
        "--data.max_sequence_length=256",
        "--model.remat_policy=full",
        "--train.per_device_train_batch_size=2",
        "--train.gradient_accumulation_steps=4",
    ]
    now = summary(run_plan(*common))["hbm_bytes"]
    before = summary(run_plan(*common, prelude=BF16_LOOKUP))["hbm_bytes"]
    assert now["arguments"] == before["arguments"]
    saved = before["temporaries"] - now["temporaries"]
    # One bf16 [vocab, hidden] buffer, to within what other buffers shift at the peak: with
    # splash 67,173,376 bytes saved, with flash (2026-12-08) 67,075,072, 33 KB (0.05%) short.
    assert saved >= 0.999 * vocab * hidden * 2, (now, before)


BY_VALUE = """
import rewardax.steps
rewardax.steps._sums_by_reference = lambda *args: False
"""


def test_gradients_summed_by_reference_need_no_gradient_buffer_per_microbatch(tmp_path):
    """Compiled for a v5e, a step of 4 microbatches: with the running sums as references that
    each backward pass adds into (`Kernels.accumulate_by_reference`, a TPU's default), the
    layer loop's backward adds each layer's gradient into its slice of the sum in place.
    Returned by value, the layers' gradients were a float32 buffer of their own per microbatch,
    added to the sum after: the step needs at least that much less (Qwen2.5-0.5B at 1 x 8 of
    2048: 2.58 GiB). 12 layers: more than `transformer.UNROLLED_MAX_LAYERS`, run as a loop."""
    hidden, mlp, kv, n = 1024, 4096, 2 * 64, 12
    arch = {**ARCH, "hidden_size": hidden, "intermediate_size": mlp, "num_hidden_layers": n}
    (tmp_path / "config.json").write_text(json.dumps(arch))
    common = [
        "--topology=v5e:1x1",
        f"--model.path={tmp_path}",
        "--data.max_sequence_length=256",
        "--model.remat_policy=full",
        "--train.per_device_train_batch_size=1",
        "--train.gradient_accumulation_steps=4",
    ]
    now = summary(run_plan(*common))["hbm_bytes"]
    by_value = summary(run_plan(*common, prelude=BY_VALUE))["hbm_bytes"]
    assert now["arguments"] == by_value["arguments"]
    layers = n * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp + 2 * hidden)
    saved = by_value["temporaries"] - now["temporaries"]
    assert saved >= 4 * layers, (now, by_value, 4 * layers)


SCANNED = """
import dataclasses
import rewardax.plan
_select = rewardax.plan.select_kernels
rewardax.plan.select_kernels = lambda *a, **k: dataclasses.replace(
    _select(*a, **k), indexed_layers=False)
"""


def test_indexed_layers_add_weight_gradients_into_the_sums_without_copies(tmp_path):
    """Compiled for a v5e, a step of 4 microbatches summed by reference: over the stacked
    parameters, XLA copies each MLP matrix's slice of the float32 sum out (a fusion of its own)
    before the matmul adds the layer's gradient into it; with `Kernels.indexed_layers` the add
    (a TPU's default) reads the slice inside the matmul's fusion, and no such copy is left. 12
    layers of 1024: looped, like Qwen2.5-0.5B, where the copies took ~19 ms of a 372 ms step at
    16 x 512 (that step: 339 ms with indexed layers, on the chip)."""
    hidden, mlp, n = 1024, 4096, 12
    arch = {**ARCH, "hidden_size": hidden, "intermediate_size": mlp, "num_hidden_layers": n}
    (tmp_path / "config.json").write_text(json.dumps(arch))
    common = [
        "--topology=v5e:1x1",
        f"--model.path={tmp_path}",
        "--data.max_sequence_length=256",
        "--model.remat_policy=save_attention_mlp",
        "--train.per_device_train_batch_size=1",
        "--train.gradient_accumulation_steps=4",
    ]
    # A fusion whose output is one layer's float32 slice of an MLP matrix (ENTRY or loop level).
    copy = re.compile(rf"^  %\S+ = f32\[1,({hidden},{mlp}|{mlp},{hidden})\]\S* fusion\(", re.M)
    copies = {}
    for name, prelude in (("scanned", SCANNED), ("indexed", "")):
        summary(run_plan(*common, prelude=prelude, hlo_dir=tmp_path / name))
        (program,) = (tmp_path / name).glob("*in_mesh*.after_optimizations.txt")
        copies[name] = len(copy.findall(program.read_text()))
    assert copies == {"scanned": 3, "indexed": 0}
