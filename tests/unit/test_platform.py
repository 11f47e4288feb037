"""Platform detection (on this CPU machine) and simulation."""
from __future__ import annotations

import pytest

from kvstrata import platform as plat

ALL_KINDS = ["cuda", "hip", "npu", "xpu", "mps", "cpu"]
PREDICATES = {"cuda": plat.is_cuda, "hip": plat.is_hip, "npu": plat.is_npu,
              "xpu": plat.is_xpu, "mps": plat.is_mps, "cpu": plat.is_cpu}


def test_detects_cpu_on_this_machine():
    import torch
    if torch.cuda.is_available():
        pytest.skip("machine has a GPU")
    p = plat.detected_platform()
    assert p.kind == "cpu" and not p.simulated
    assert p.device_type == "cpu"
    assert plat.is_cpu() and not plat.is_cuda() and not plat.is_hip()
    assert not plat.is_npu() and not plat.is_xpu() and not plat.is_cuda_alike()
    # the host facts the CPU dtype rule reads (a fresh detection: torch's threads now)
    fresh = plat.detect_platform()
    assert fresh.cpu_threads == torch.get_num_threads() >= 1
    assert fresh.cpu_flags == plat.read_cpu_flags()
    assert plat.simulated("cpu").cpu_threads == 0


def test_detection_is_cached():
    assert plat.current_platform() is plat.current_platform()
    assert plat.detected_platform() is plat.detected_platform()


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_simulate_platform_drives_every_predicate(kind):
    real = plat.current_platform()
    with plat.simulate_platform(kind) as p:
        assert p.simulated and plat.current_platform() is p
        for other, pred in PREDICATES.items():
            assert pred() == (other == kind), other
        assert plat.is_cuda_alike() == (kind in ("cuda", "hip"))
        # detection still reports the real machine (serve refuses a mismatching --platform)
        assert plat.detected_platform() is real
    assert plat.current_platform() is real


def test_simulation_nests_and_unwinds_on_error():
    with plat.simulate_platform("cuda"):
        with pytest.raises(RuntimeError):
            with plat.simulate_platform("hip"):
                assert plat.is_hip()
                raise RuntimeError("boom")
        assert plat.is_cuda()
    assert not plat.current_platform().simulated


def test_device_types():
    assert {k: plat.simulated(k).device_type for k in ALL_KINDS} == {
        "cuda": "cuda", "hip": "cuda", "npu": "npu", "xpu": "xpu", "mps": "mps", "cpu": "cpu"}


def test_unknown_kind_rejected():
    with pytest.raises(ValueError, match="unknown platform kind 'tpu'"):
        plat.simulated("tpu")


def test_no_torch_version_hip_outside_platform_module():
    # The grep rule: platform-dependent branches go through kvstrata.platform.
    import pathlib
    root = pathlib.Path(plat.__file__).parent
    detectors = ("torch.version.hip", "torch.cuda.is_available", "torch.npu", "torch.xpu")
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "platform.py" and any(d in p.read_text() for d in detectors)]
    assert offenders == []
