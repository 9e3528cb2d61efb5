"""Granule arithmetic and block footprints from layouts (pure Python; vLLM's real backend
layouts are checked in tests/vllm/test_elastic_layout.py)."""

import pytest

from proxima.memory.layout import (LayoutError, block_footprint, check_block_major,
                                   granule_blocks, guess_block_dim)

MiB = 1 << 20


def contiguous_strides(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


@pytest.mark.parametrize("strides, expected", [
    ([64 * 1024], 32),            # Llama-3.1-8B page (16 tok x 8 heads x 2 x 128 x bf16)
    ([8 * 1024], 256),            # the tiny Llama's page
    ([64 * 1024, 8 * 1024], 256), # every region whole: the lcm
    ([24 * 1024], 256),           # 2 MiB / gcd(24 KiB, 2 MiB)
    ([6 * MiB], 1),               # a page bigger than a granule, a multiple of it
    ([3 * MiB], 2),
])
def test_granule_blocks_is_the_smallest_whole_granule_count(strides, expected):
    g = granule_blocks(strides, 2 * MiB)
    assert g == expected
    assert all(g * s % (2 * MiB) == 0 for s in strides)
    assert not any(all(k * s % (2 * MiB) == 0 for s in strides) for k in range(1, g))


def test_footprint_of_a_block_major_nhd_view_is_one_page():
    # vLLM 0.26 FlashAttention: logical (nb, H, bs, 2D), physical NHD (nb, bs, H, 2D)
    nb, h, bs, d2 = 10, 8, 16, 256
    strides = (bs * h * d2, d2, h * d2, 1)
    stride, pieces = block_footprint((nb, h, bs, d2), strides, 2, block_dim=0)
    assert stride == 64 * 1024 and pieces == [(0, 64 * 1024)]
    assert guess_block_dim((nb, h, bs, d2), strides, nb) == 0
    check_block_major((nb, h, bs, d2), strides, 2, 0, nb, 64 * 1024)


def test_separate_k_and_v_halves_are_detected_and_refused():
    nb, bs, h, d = 10, 16, 8, 128
    shape = (2, nb, bs, h, d)                    # the older (2, num_blocks, ...) layout
    strides = contiguous_strides(shape)
    stride, pieces = block_footprint(shape, strides, 2, block_dim=1)
    half = bs * h * d * 2
    assert stride == half and pieces == [(0, half), (nb * half, half)]
    with pytest.raises(LayoutError, match="not block-major"):
        check_block_major(shape, strides, 2, 0, nb, 2 * half)


def test_padded_and_packed_pages_stay_inside_their_block_stride():
    nb, h, bs, d2 = 4, 2, 16, 128
    page = h * bs * d2 * 2
    padded = page + 4096
    strides = (padded // 2, d2, h * d2, 1)       # pages with padding between them
    check_block_major((nb, h, bs, d2), strides, 2, 0, nb, padded)
    # a layer at byte 4096 inside a packed block of 3 pages: still its own block's bytes
    packed = 3 * page
    check_block_major((nb, h, bs, d2), (packed // 2, d2, h * d2, 1), 2, 4096, nb, packed)
    with pytest.raises(LayoutError):             # the same view claimed in a smaller page
        check_block_major((nb, h, bs, d2), (packed // 2, d2, h * d2, 1), 2, 4096, nb, page)


def test_kernel_blocks_smaller_than_the_schedulers_block():
    # 2 kernel blocks of 16 tokens make one scheduler block of 32
    nb = 6
    shape = (2 * nb, 8, 16, 256)
    strides = (16 * 8 * 256, 256, 8 * 256, 1)
    stride, pieces = block_footprint(shape, strides, 2, 0, blocks_per_block=2)
    assert stride == 2 * 64 * 1024 and pieces == [(0, 2 * 64 * 1024)]
    check_block_major(shape, strides, 2, 0, nb, 2 * 64 * 1024)


def test_no_block_dimension_is_a_clear_error():
    with pytest.raises(LayoutError, match="counts 7 blocks"):
        guess_block_dim((10, 8, 16), (128, 16, 1), 7)
