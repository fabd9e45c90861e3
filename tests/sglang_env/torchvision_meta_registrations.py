# Test-environment shim for torchvision's _meta_registrations.py, installed by
# scripts/sglang_env.sh, which keeps the original next to it as
# _meta_registrations_upstream.py.
#
# The PyPI torchvision is linked against CUDA torch. With the CPU torch its C++
# extension does not load, torch.ops.torchvision has no operators, and the
# original's fake-tensor registrations fail at import ("operator torchvision::nms
# does not exist"), taking transformers and SGLang down with them. Those
# registrations describe the extension's operators: they matter only when it loaded.
import torchvision.extension

if torchvision.extension._has_ops():
    from torchvision._meta_registrations_upstream import *  # noqa: F401,F403
