"""MCVA pure functions: block-sharing masks, query locations, target normalisation, the per-round loss."""


import pytest
import torch

from flowformer.models.mcva import (
    block_sharing_noise,
    cost_token_grid,
    expand_block_noise,
    normalize_per_pixel,
    recon_locations,
    reconstruction_loss,
)

from helpers.configs import FIXTURES_DIR, mask_generator

FIXTURE_C = FIXTURES_DIR / "flowformer_pp_c"


@pytest.fixture(scope="module")
def fixture_c() -> dict:
    if not (FIXTURE_C / "expected.pt").exists():
        pytest.skip(f"fixture C not found at {FIXTURE_C}")
    return torch.load(FIXTURE_C / "expected.pt", weights_only=False)


def test_token_grid_pads_cost_maps_to_multiples_of_eight():
    assert cost_token_grid(46, 62) == (6, 8)
    assert cost_token_grid(8, 12) == (1, 2)
    assert cost_token_grid(16, 16) == (2, 2)


def test_block_expansion_reproduces_the_official_mask_noise(fixture_c):
    for b in range(2):
        gh, gw, start_h, start_w = (int(v) for v in fixture_c["mask_gen_params"][b])
        noise = expand_block_noise(
            fixture_c["mask_gen_low_noise"][b],
            block_hw=(gh, gw),
            offset_hw=(start_h, start_w),
            out_hw=(46, 62),
        )
        assert torch.equal(noise, fixture_c["mask_noise"][b])


def test_token_mask_from_the_official_noise_matches_ids_keep_and_key_mask(fixture_c):
    token_mask = mask_generator(masking="block", mask_ratio=0.5).token_mask(fixture_c["mask_noise"])
    assert torch.equal(token_mask.ids_keep, fixture_c["ids_keep"])
    assert torch.equal(token_mask.removed, fixture_c["mask_for_keys"])


def test_random_locations_follow_the_official_formula(fixture_c):
    for q in (0, 17, 29):
        coords = recon_locations(
            fixture_c["query_uniform"][q], shape=(2, 46, 62), recon_size=15, location="random"
        )
        torch.testing.assert_close(coords, fixture_c["coords_outter"][q], rtol=0, atol=1e-6)


@pytest.mark.parametrize("h1,w1", [(46, 62), (8, 12), (13, 29)])
def test_block_sharing_noise_is_constant_per_block_for_any_grid(h1, w1):
    gen = torch.Generator().manual_seed(3)
    num_tokens = cost_token_grid(h1, w1)[0] * cost_token_grid(h1, w1)[1]
    noise, params = block_sharing_noise(6, h1, w1, num_tokens, min_block=4, max_block=15, generator=gen)
    assert noise.shape == (6, h1, w1, num_tokens)
    for b in range(6):
        gh, gw, start_h, start_w = (int(v) for v in params[b])
        assert 4 <= gh <= 15 and 4 <= gw <= 15
        assert 0 <= start_h <= (h1 // gh + 2) * gh - h1 - 1
        assert 0 <= start_w <= (w1 // gw + 2) * gw - w1 - 1
        block_id = ((torch.arange(h1)[:, None] + start_h) // gh) * 1000 + (
            torch.arange(w1)[None] + start_w
        ) // gw
        for bid in block_id.unique():
            rows = noise[b][block_id == bid]
            assert torch.equal(rows, rows[:1].expand_as(rows)), "pixels of one block must share the noise"
        assert noise[b].reshape(-1, num_tokens).unique(dim=0).shape[0] == block_id.unique().numel()


def test_block_offsets_and_sizes_vary_between_samples():
    _, params = block_sharing_noise(
        64, 46, 62, 48, min_block=4, max_block=15, generator=torch.Generator().manual_seed(0)
    )
    assert params[:, 0].unique().numel() > 5 and params[:, 2].unique().numel() > 3


@pytest.mark.parametrize("strategy", ["block", "random"])
@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.8])
def test_exactly_int_l_times_one_minus_ratio_tokens_stay_visible(strategy, ratio):
    generator = mask_generator(masking=strategy, mask_ratio=ratio)
    noise = generator.noise(2, 46, 62, generator=torch.Generator().manual_seed(1))
    mask = generator.token_mask(noise)
    n_keep = int(48 * (1 - ratio))
    assert mask.ids_keep.shape == (2 * 46 * 62, n_keep)
    assert torch.equal((1 - mask.removed).sum(1), torch.full((2 * 46 * 62,), float(n_keep)))
    # the kept tokens are the smallest-noise ones, listed in ascending-noise order
    flat = noise.reshape(-1, 48)
    kept_noise = flat.gather(1, mask.ids_keep)
    assert (kept_noise[:, 1:] >= kept_noise[:, :-1]).all()
    assert (kept_noise.max(1).values <= flat.masked_fill(mask.removed.bool(), 2.0).max(1).values).all()


def test_random_masking_does_not_share_masks_between_neighbours():
    generator = mask_generator(masking="random", mask_ratio=0.5)
    mask = generator.token_mask(generator.noise(1, 46, 62, generator=torch.Generator().manual_seed(0)))
    distinct = mask.removed.unique(dim=0).shape[0]
    assert distinct > 0.95 * 46 * 62
    block = mask_generator(masking="block", mask_ratio=0.5)
    block_mask = block.token_mask(block.noise(1, 46, 62, generator=torch.Generator().manual_seed(0)))
    assert block_mask.removed.unique(dim=0).shape[0] <= 8 * 10


def test_bad_mask_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="masking="):
        mask_generator(masking="grid")
    with pytest.raises(ValueError, match="mask_ratio"):
        mask_generator(mask_ratio=1.0)
    with pytest.raises(ValueError, match="keeps no cost-map patch"):
        mask_generator(mask_ratio=0.99).token_mask(torch.rand(1, 8, 12, 2))


def test_random_locations_keep_the_window_inside_the_map():
    uniform = torch.tensor([0.0, 1.0 - 2**-24]).reshape(2, 1, 1, 1).expand(2, 2, 46, 62)
    coords = recon_locations(uniform, shape=(2, 46, 62), recon_size=25, location="random")
    assert coords[0, 0].min() == 12 and coords[0, 1].min() == 12
    assert coords[1, 0].max() < 62 - 12 and coords[1, 1].max() < 46 - 12


def test_fixed_locations_are_each_pixels_own_position():
    coords = recon_locations(None, shape=(2, 5, 7), recon_size=15, location="fixed")
    assert coords.shape == (2, 2, 5, 7)
    assert torch.equal(coords[1, 0, 3], torch.arange(7.0)) and torch.equal(
        coords[1, 1, :, 4], torch.arange(5.0)
    )
    with pytest.raises(ValueError, match="fixed"):
        recon_locations(torch.rand(2, 2, 5, 7), shape=(2, 5, 7), recon_size=15, location="fixed")


def test_normalisation_is_per_pixel_with_unbiased_variance(fixture_c):
    values = torch.randn(2, 225, 3, 4) * 50 + 7
    out = normalize_per_pixel(values)
    torch.testing.assert_close(out.mean(1), torch.zeros(2, 3, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.var(1), torch.ones(2, 3, 4), atol=1e-4, rtol=0)
    # the fixture targets are normalised that way: their unbiased per-pixel variance is 1 (up to the 1e-6 eps)
    target = fixture_c["target_full"][0]
    torch.testing.assert_close(target.var(1), torch.ones_like(target.var(1)), atol=1e-3, rtol=0)


def test_loss_normalises_the_chosen_side():
    target = torch.randn(1, 9, 2, 2) * 30 + 100
    torch.testing.assert_close(
        reconstruction_loss(normalize_per_pixel(target), target, normalize="target"), torch.tensor(0.0)
    )
    prediction = torch.randn(1, 9, 2, 2)
    expected = ((target - normalize_per_pixel(prediction)) ** 2).mean()
    torch.testing.assert_close(reconstruction_loss(prediction, target, normalize="prediction"), expected)
    with pytest.raises(ValueError, match="recon_size"):
        reconstruction_loss(torch.zeros(1, 25, 2, 2), target, normalize="target")
    with pytest.raises(ValueError, match="normalize="):
        reconstruction_loss(target, target, normalize="both")
