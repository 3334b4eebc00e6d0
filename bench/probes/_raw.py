"""Raw CUDA C++ for the micro-benchmark probes (mma_rate.py, l1_loop_forms.py): compiled with cuda.core for this
GPU's architecture, with the package's launch stream."""
import torch

try:
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch
except ImportError:  # cuda-core < 0.4
    from cuda.core.experimental import Device, LaunchConfig, Program, ProgramOptions, launch

__all__ = ["compile_probe", "LaunchConfig", "launch"]


def compile_probe(source: str, names):
    """(cubin object code with ``names`` instantiated, SM count, the stream to launch on) for the current GPU."""
    Device(torch.cuda.current_device()).set_current()
    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    obj = Program(source, "c++", ProgramOptions(arch=f"sm_{major}{minor}", std="c++17")).compile(
        "cubin", name_expressions=list(names))
    from kermac_like.runtime.launcher import _stream_for
    return obj, sms, _stream_for(torch.cuda.current_device())
