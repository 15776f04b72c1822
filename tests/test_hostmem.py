"""rewardax.hostmem: freed host memory is kept for the next step (fewer page faults), and the
settings refuse to apply where they cannot or should not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from rewardax import hostmem

# A jitted function whose 64 MiB intermediate (h) lives in XLA's per-call scratch buffer: above
# glibc's 32 MiB mmap ceiling, so by default each call maps it afresh and faults it in again.
_CHILD = r"""
import json, resource, sys
import rewardax
applied = rewardax.retain_freed_memory()
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
print(json.dumps({"applied": applied, "status": rewardax.hostmem.status(),
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


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the settings are glibc's (Linux only)"
)
def test_retained_memory_removes_the_page_faults_of_each_call():
    off = _run_child("0")
    on = _run_child("1")
    assert off["applied"] is False and "REWARDAX_RETAIN_HOST_MEMORY is off" in off["status"]
    assert on["applied"] is True and on["status"].startswith("applied; ")
    assert on["value"] == off["value"]  # the same computation
    # 64 MiB is 16,384 pages: without the settings each call faults (almost) all of them in.
    assert off["faults_per_call"] > 10_000
    assert on["faults_per_call"] < 0.1 * off["faults_per_call"]


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
