"""rewardax.hostmem: freed host memory is kept for the next step (fewer page faults), the settings
refuse to apply where they cannot or should not, and only the `rewardax` command applies them
without being asked (the library leaves the embedding program's malloc alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jax.numpy as jnp
import pytest

from data_fixtures import smollm2_tokenizer, tiny_llama
from rewardax import hostmem

TINY = Path(__file__).resolve().parents[1] / "src" / "rewardax" / "configs" / "tiny.yaml"
RX = Path(sys.executable).parent / "rewardax"
TRAIN = resources.files("rewardax") / "assets" / "vader_movie_pairs.train.jsonl"

# A jitted function whose 64 MiB intermediate (h) lives in XLA's per-call scratch buffer: above
# glibc's 32 MiB mmap ceiling, so by default each call maps it afresh and faults it in again.
_CHILD = r"""
import json, resource, sys
from rewardax import hostmem
applied = hostmem.retain_freed_memory()
import jax, jax.numpy as jnp
x = jnp.ones((4096, 256), jnp.float32)
w1 = jnp.ones((256, 4096), jnp.float32) / 256
w2 = jnp.ones((4096, 8), jnp.float32)
f = jax.jit(lambda x, w1, w2: (jnp.tanh(x @ w1) @ w2).sum())
for _ in range(3):
    f(x, w1, w2).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    value = float(f(x, w1, w2))
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
huge_kib = 0
with open("/proc/self/smaps_rollup") as f:
    for line in f:
        if line.startswith("AnonHugePages:"):
            huge_kib = int(line.split()[1])
print(json.dumps({"applied": applied, "status": hostmem.status(),
                  "faults_per_call": faults, "value": value, "huge_kib": huge_kib}))
"""


def _run_child(switch: str, huge_pages: str = "1") -> dict:
    env = {
        **os.environ,
        hostmem.ENV_SWITCH: switch,
        hostmem.HUGE_PAGES_SWITCH: huge_pages,
        "JAX_PLATFORMS": "cpu",
    }
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# What the settings ask of glibc, read back from glibc's own accounting (mallinfo2): a 64 MiB
# block comes from the heap instead of a fresh mmap, and the heap keeps it once freed. The page
# faults this saves per training step are measured by benchmarks/bench_host_memory.py.
_MALLINFO_CHILD = r"""
import ctypes, json
from rewardax import hostmem
applied = hostmem.retain_freed_memory()
libc = ctypes.CDLL("libc.so.6")
names = ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost").split()
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in names]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2()
block = libc.malloc(64 << 20)
during = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(json.dumps({"applied": applied, "status": hostmem.status(),
                  "mmapped": during.hblkhd - before.hblkhd, "heap_during": during.arena,
                  "heap_after": after.arena}))
"""


def _mallinfo_child(switch: str) -> dict:
    env = {**os.environ, hostmem.ENV_SWITCH: switch, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _MALLINFO_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the settings are glibc's (Linux only)"
)
def test_large_blocks_come_from_a_heap_that_keeps_them_once_freed():
    off, on = _mallinfo_child("0"), _mallinfo_child("1")
    assert off["applied"] is False and "REWARDAX_RETAIN_HOST_MEMORY is off" in off["status"]
    assert on["applied"] is True and on["status"].startswith("applied; ")
    mib = 1 << 20
    # glibc's defaults: a block this large is mmapped on its own and unmapped when freed.
    assert off["mmapped"] >= 64 * mib
    assert off["heap_after"] < 64 * mib
    # rewardax's settings: the block comes from the heap, and the heap is never trimmed.
    assert on["mmapped"] == 0
    assert on["heap_during"] >= 64 * mib
    assert on["heap_after"] >= on["heap_during"]


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the settings are glibc's (Linux only)"
)
def test_heap_is_backed_by_huge_pages_where_the_kernel_gives_them_on_request():
    mode = hostmem.thp_mode()
    on = _run_child("1")
    if mode == "madvise":
        # The reserved range is marked: the 64 MiB intermediate and the arrays land on 2 MiB pages.
        assert "GiB of heap on transparent huge pages" in on["status"], on["status"]
        assert on["huge_kib"] >= 32 * 1024
    elif mode is None:
        assert on["status"] == "applied; no transparent huge pages (kernel without THP)"
    else:  # always / never: left to the kernel, nothing reserved
        assert on["status"] == f"applied; transparent huge pages '{mode}' (left to the kernel)"
    off = _run_child("1", huge_pages="0")
    assert off["status"] == f"applied; no huge-page heap ({hostmem.HUGE_PAGES_SWITCH} is off)"
    assert off["value"] == on["value"]
    if mode == "madvise":
        assert off["huge_kib"] < on["huge_kib"]


def test_refuses_once_a_backend_started(monkeypatch):
    jnp.ones(2).block_until_ready()  # JAX's CPU backend is up in this process
    monkeypatch.setattr(hostmem, "_status", "not requested yet")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv(hostmem.ENV_SWITCH, "1")
    assert hostmem.retain_freed_memory() is False
    assert "already started" in hostmem.status()
    assert "before the first JAX computation" in hostmem.status()


def test_refuses_when_jax_runs_on_an_accelerator(monkeypatch):
    monkeypatch.setattr(hostmem, "_status", "not requested yet")
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    monkeypatch.setenv(hostmem.ENV_SWITCH, "1")
    assert hostmem.retain_freed_memory() is False
    assert hostmem.status() == "JAX runs on an accelerator (JAX_PLATFORMS=cuda,cpu)"


# Builds a RewardTrainer (which starts JAX's CPU backend) from a config naming a model directory,
# then says what became of malloc. Nothing JAX-related runs before the constructor, so a trainer
# that still called retain_freed_memory() would get "applied" here.
_TRAINER_CHILD = r"""
import json, sys
import rewardax as rx
from rewardax import hostmem
model_dir, train, tiny = sys.argv[1:4]
config = rx.RewardConfig.from_yaml(tiny, [f"model.path={model_dir}", "checkpoint.save_directory=" + sys.argv[4]])
trainer = rx.RewardTrainer(config, rx.load_tokenizer(model_dir), train_dataset=train)
print(json.dumps({"status": hostmem.status(), "backend_started": hostmem._backend_started()}))
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    tokenizer = smollm2_tokenizer()
    path = tmp_path_factory.mktemp("hostmem") / "tiny-model"
    tiny_llama(tokenizer).save_pretrained(path, tokenizer=tokenizer)
    return path


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the settings are glibc's (Linux only)"
)
@pytest.mark.slow
def test_only_the_command_changes_malloc(tiny_model_dir, tmp_path):
    env = {**os.environ, hostmem.ENV_SWITCH: "1", "JAX_PLATFORMS": "cpu"}
    train = tmp_path / "train.jsonl"
    train.write_text("".join(TRAIN.read_text().splitlines(keepends=True)[:16]))
    args = [str(tiny_model_dir), str(train), str(TINY), str(tmp_path / "lib-runs")]
    library = subprocess.run(
        [sys.executable, "-c", _TRAINER_CHILD, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert library.returncode == 0, library.stderr[-2000:]
    child = json.loads(library.stdout.strip().splitlines()[-1])
    assert child["backend_started"] is True  # the constructor started JAX: it had its chance
    assert child["status"] == "not requested yet"

    runs = tmp_path / "cli-runs"
    command = subprocess.run(
        [
            str(RX),
            "train",
            "--config",
            str(TINY),
            "--train",
            str(train),
            f"--model.path={tiny_model_dir}",
            f"--checkpoint.save_directory={runs}",
            "--checkpoint.run_name=run",
            "--train.max_training_steps=1",
            "--no-report",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert command.returncode == 0, command.stderr[-3000:]
    summary = json.loads((runs / "run" / "summary.json").read_text())
    assert summary["host_memory"].startswith("applied; "), summary["host_memory"]
