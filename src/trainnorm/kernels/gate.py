"""The gate's activation and its derivative: the one place a kernel knows which
function gates the norm. A new activation is one branch here and one entry of
`reference.GATE_ACTIVATIONS` (its name is the variant's `gate`)."""
import triton
import triton.language as tl


@triton.jit
def gate_activation(b_z, ACT: tl.constexpr):
    """(a(z), a'(z)) in float32 for a tile of the gate z (float32)."""
    b_sig = tl.sigmoid(b_z)
    if ACT == "sigmoid":
        b_a = b_sig
        b_da = b_sig * (1.0 - b_sig)
    else:  # "silu": z * sigmoid(z)
        b_a = b_z * b_sig
        b_da = b_sig * (1.0 + b_z * (1.0 - b_sig))
    return b_a, b_da


@triton.jit
def load_gate(Z, o_z, mask, ACT: tl.constexpr):
    """(a(z), a'(z)) for the tile of the gate at offsets o_z."""
    return gate_activation(tl.load(Z + o_z, mask=mask, other=0.0).to(tl.float32), ACT)
