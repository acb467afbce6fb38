"""The megatron-core version check: a core outside 0.16.x stops the model build with one line
naming the installed version and the requirement, instead of building a model whose position-id
RoPE never applies (megatron-core 0.12, MindSpeed's released line)."""
import pytest

from periodic_async.models import mcore
from periodic_async.models.mcore import UnsupportedMegatronCore, check_megatron_core


def test_installed_core_is_supported():
    from megatron.core import package_info
    assert check_megatron_core() == package_info.__version__


@pytest.mark.parametrize("version", ["0.16.0", "0.16.1", "0.16.0rc0"])
def test_the_016_series_is_accepted(version):
    assert check_megatron_core(version) == version


@pytest.mark.parametrize("version", ["0.12.1", "0.15.3", "0.17.1", "1.16.0", "core_r0.16.0"])
def test_other_cores_are_refused_with_the_requirement(version):
    with pytest.raises(UnsupportedMegatronCore) as e:
        check_megatron_core(version)
    msg = str(e.value)
    assert f"megatron-core {version} is installed" in msg and ">= 0.16.0, < 0.17" in msg
    assert "MindSpeed's core_r0.16.0 branch" in msg and "\n" not in msg


def test_build_refuses_an_unsupported_core_before_building(monkeypatch):
    from megatron.core import package_info
    from periodic_async.config import TinyModelConfig
    from periodic_async.models.tiny import tiny_arch
    monkeypatch.setattr(package_info, "__version__", "0.12.1")
    with pytest.raises(UnsupportedMegatronCore, match="megatron-core 0.12.1 is installed"):
        mcore.build_gpt_model(tiny_arch(TinyModelConfig()))
