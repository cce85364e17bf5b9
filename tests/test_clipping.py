"""``[training] max_norm`` means the same for an optimizer that owns R as for AdamW-HSDP.

Both replicas read the same text (every line of the file is the same document), so their
gradients agree and the replicas' mean gradient is each replica's own: AdamW-HSDP's ``grad_norm``
(the norm of the all-reduced gradient) and ours (``sqrt(mean_r |g_r|^2)``) must be equal, and with
``eps = 1`` Adam's update is nearly linear in the clipped gradient, so LocalAdam (every replica an
AdamW on identical data) tracks AdamW-HSDP's losses only if both clip by the same factor. 2x2 HSDP
(4 processes): with a shard degree of 1 torchtitan applies DDP instead, which averages on top of the
global-token loss (its ``grad_norm`` is the mean gradient's over W).
"""

import pytest

from tests.titan_utils import losses, run_train

LINE = (
    "One morning, Mia went to the market. The small streets were busy, and rain fell softly. "
    "Mia had 3 apples. Leo gave her 2 more apples. Now Mia had 5 apples."
)
MAX_NORM = 0.1


def _run(tmp_path, name, data):
    _, scalars = run_train(
        tmp_path / name, 4, "--optimizer.name", name, "--model.flavor", "cpu_tiny", "--training.steps", "3",
        "--parallelism.data_parallel_replicate_degree", "2", "--optimizer.eps", "1.0",
        "--training.max_norm", str(MAX_NORM), "--training.dataset", "textfile", "--training.dataset_path", str(data),
    )
    return [v for _, v in sorted(scalars["grad_norm"])], losses(scalars)


def test_max_norm_and_grad_norm_match_adamw_hsdp(tmp_path):
    data = tmp_path / "same.txt"
    data.write_text((LINE + "\n") * 64)
    adamw_norms, adamw_losses = _run(tmp_path, "AdamW", data)
    ours_norms, ours_losses = _run(tmp_path, "LocalAdam", data)
    assert len(ours_norms) == len(adamw_norms) == 3
    assert ours_norms[0] == pytest.approx(adamw_norms[0], rel=1e-5)
    assert min(adamw_norms) > 5 * MAX_NORM  # the clip is active at every step
    assert ours_losses == pytest.approx(adamw_losses, rel=1e-5)  # same clipped updates
