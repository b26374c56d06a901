import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def get_activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"Unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}.")
    return ACTIVATIONS[name]
