"""What every op shares for its torch.library registration.

Each public op is a thin wrapper over a custom op ``kermac_like::<name>`` (and
``kermac_like::<name>_out`` for ``out=``, which mutates ``out``), registered with
``torch.library.custom_op`` next to the wrapper in ``ops/<op>.py``. Schemas carry only
what torch can type, so:

* a :class:`~kermac_like.descriptor.KernelDescriptor` travels as four ints
  (:func:`descriptor_ints` / :func:`descriptor_from_ints`);
* a hyper-parameter that is a float or a tensor travels as ``float? name`` plus
  ``Tensor? name_tensor`` (:func:`split_hyper` / :func:`join_hyper`).

Eager calls skip the dispatcher when it has nothing to do (:func:`direct_call`): no
autograd, no compile or trace, no tensor subclass, no dispatch or function mode, no
profiler. The wrapper then calls the very function registered as the op's
implementation, so the results are the same; what is saved is the dispatcher's Python
round trip (tens of microseconds per call, ``bench/notes/ops.md``). Set
``KERMAC_LIKE_DIRECT_EAGER=0`` to send every call through the dispatcher.

Differentiable eager calls do the same under the same conditions (``direct_call(...,
grad=False)``): :func:`register_autograd` registers the op's backward and returns a plain
``torch.autograd.Function`` that runs the op's implementation and records the very
``setup_context`` and ``backward`` registered with the op, as torch's custom-op autograd
kernel does (torch/_library/autograd.py). Through the dispatcher, the first call of a custom
op's implementation imports ``torch._dynamo`` (torch._disable_dynamo: 2-4 s, sympy
included) even when nothing compiles; the Function does not. The backwards' own op calls
take :func:`call_op`. Under torch.compile, modes, tensor subclasses or functorch
transforms every call goes through the op.
"""

from __future__ import annotations

import functools

import torch

from .. import config
from ..descriptor import InnerOperator, KernelDescriptor, KernelType, PowerType

__all__ = ["NAMESPACE", "descriptor_ints", "descriptor_from_ints", "split_hyper", "join_hyper", "direct_call",
           "call_op", "register_autograd"]

NAMESPACE = "kermac_like"


def descriptor_ints(desc: KernelDescriptor) -> list:
    if not desc.fused_ok:  # a formula kernel: its ops compute it on the torch path, never through an op schema
        raise TypeError(f"descriptor: {desc!r} is not one of the fused descriptors the ops' schemas carry")
    return [int(desc.inner_operator), int(desc.inner_power), int(desc.outer_power), int(desc.kernel_type)]


@functools.lru_cache(maxsize=None)
def _descriptor(ints: tuple) -> KernelDescriptor:
    i, p, o, k = ints
    return KernelDescriptor(InnerOperator(i), PowerType(p), PowerType(o), KernelType(k))


def descriptor_from_ints(ints) -> KernelDescriptor:
    return _descriptor(tuple(int(v) for v in ints))


def split_hyper(x) -> tuple:
    """(float or None, Tensor or None) of a checked hyper-parameter."""
    if isinstance(x, torch.Tensor):
        return None, x
    return x, None


def join_hyper(value, tensor):
    return tensor if tensor is not None else value


def check_no_hyper_grad(hypers: dict, op: str) -> None:
    """NotImplementedError naming every tensor hyper-parameter of an ``op`` call that requires grad."""
    names = [k for k, v in hypers.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if names:
        raise NotImplementedError(f"{', '.join(names)}: gradients of {op} with respect to hyper-parameters are not "
                                  "supported (pass them detached)")


def join_hypers(ip, ipt, op, opt, bw, bwt, rg, rgt) -> dict:
    """The distance hyper-parameters (inner_p, outer_p, bandwidth, regularization) of an op's (number,
    tensor) argument pairs."""
    return dict(inner_p=join_hyper(ip, ipt), outer_p=join_hyper(op, opt), bandwidth=join_hyper(bw, bwt),
                regularization=join_hyper(rg, rgt))


def direct_call(*tensors, grad: bool = True) -> bool:
    """Whether an eager call may run the op's implementation without the dispatcher:
    nothing but the backend kernel would act on it (``grad=False``: the op takes no part
    in autograd, so inputs that require grad do not matter). Checked in this order so
    that a compiling tracer stops at the first test (and records the op)."""
    if torch.compiler.is_compiling() or not config.get("direct_eager"):
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._are_functorch_transforms_active() or torch.autograd._profiler_enabled():
        return False
    grad = grad and torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or (grad and t.requires_grad)):
            return False
    return True


def call_op(op, impl, *args):
    """``op(*args)``, or ``impl(*args)`` (the op's registered implementation) where
    :func:`direct_call` allows it: the op calls inside a registered backward."""
    if direct_call(*(a for a in args if isinstance(a, torch.Tensor))):
        return impl(*args)
    return op(*args)


def register_autograd(op, impl, backward, setup_context):
    """``op.register_autograd(backward, setup_context=setup_context)``; returns ``pick(*tensors)``,
    the callable for a differentiable call on those tensors: a plain ``torch.autograd.Function``'s
    ``apply`` around ``impl`` (the op's implementation, the same backward) for eager calls that
    ``direct_call(..., grad=False)`` admits, else the op itself."""
    op.register_autograd(backward, setup_context=setup_context)

    def forward(ctx, *args):  # (autograd.Function runs it without grad, as the op's kernel does)
        out = impl(*args)
        setup_context(ctx, args, out)
        return out

    eager = type(f"Eager{impl.__name__}", (torch.autograd.Function,),
                 {"forward": staticmethod(forward), "backward": staticmethod(backward)}).apply

    def pick(*tensors):
        return eager if direct_call(*tensors, grad=False) else op  # (op: through the dispatcher)

    return pick
