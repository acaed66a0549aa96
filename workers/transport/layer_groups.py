"""One rule for cutting a Mooncake send into groups of layers that move one behind the other: the
prefill side stages (gathers, encrypts, hashes) group g + 1 while decode reads (pulled sends,
mooncake_pull_channel.py) or lands (written sends, mooncake_channel.py) group g."""
from __future__ import annotations

# About this many bytes a group. Each group costs one report, one credit and one batch transfer
# (~1 ms); a 4k-token V2-Lite send is 4 groups.
PIPELINE_PIECE_BYTES = 32 << 20


def layer_groups(layers: range, layer_bytes: int) -> list[range]:
    """`layers` cut into consecutive groups of about PIPELINE_PIECE_BYTES (`layer_bytes` each):

        layer_groups(range(27), 4_718_592)   # 64 pages of 73,728 B a layer
        -> [range(0, 7), range(7, 14), range(14, 21), range(21, 27)]
    """
    per_group = max(1, -(-PIPELINE_PIECE_BYTES // max(1, layer_bytes)))
    return [range(begin, min(begin + per_group, layers.stop)) for begin in range(layers.start, layers.stop, per_group)]
