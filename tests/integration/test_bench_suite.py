"""benchmarks/bench_suite.py `--as-cpu avx2`: the model of an AVX2-only CPU reaches every process of
both venvs (ours and vLLM's) and leaves nothing behind."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from ..conftest import REPO_ROOT


def test_as_avx2_every_process_sees_no_avx512_and_vllm_loads_its_avx2_kernels():
    """Under `--as-cpu avx2` (`--probe`): TorchInductor's cache of its own; no bf16 unit, so `precision=auto` is fp32; ATen at AVX2;
    torch.cpu's AVX512 and AMX probes False; vLLM (where its venv exists) loads `_C_AVX2`. Outside
    the model the same probe sees this CPU, and no .pth file stays in either venv."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("the model needs root and unshare(1)")
    if "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX512 to hide")
    script = [sys.executable, str(REPO_ROOT / "benchmarks" / "bench_suite.py"), "--probe"]
    as_avx2 = subprocess.run([*script, "--as-cpu", "avx2"], capture_output=True, text=True, timeout=300)
    assert as_avx2.returncode == 0, as_avx2.stderr[-3000:]
    probes = [json.loads(line) for line in as_avx2.stdout.splitlines() if line.startswith("{")]
    assert probes[0].pop("inductor_cache").endswith("/inductor")  # the model's own, not ~/.cache's or /tmp's
    assert probes[0] == {"bf16_unit": None, "auto": "torch.float32", "aten": "AVX2", "avx512": False, "amx": False}
    if len(probes) > 1:  # vLLM's venv
        assert probes[1] == {"avx512": False, "vllm_kernels": ["_C_AVX2"]}
    from bench_suite import PROBE

    native = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                                       cwd=REPO_ROOT).stdout)
    assert native["aten"] != "AVX2" and native["avx512"] is True
    site = subprocess.run([sys.executable, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert not os.path.exists(os.path.join(site, "peagle_cpu_as.pth"))
