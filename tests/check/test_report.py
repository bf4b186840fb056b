"""The report's text: a hint stated once for the rows it covers, a long failure cut to what a person
reads first (at most MAX_LINES lines), and report.table() with every row."""

from __future__ import annotations

import pytest
from expecttest import assert_expected_inline

from pipecheck._check.numerics import Row
from pipecheck._check.report import MAX_LINES, Report, format_table, pick_rows

TOL = "auto: atol 1.0e-06 rtol 2.4e-07"
SCALING = ("gradient scaling: gradient is n_microbatches (=4) times too large; each micro-batch's loss must be "
           "divided by n_microbatches")


def row(name: str, stage: int | tuple[int, ...], ok: bool = False, max_rel: float = 3.0, numel: int = 16,
        n_failing: int | None = None, note: str = "") -> Row:
    stages = (stage,) if isinstance(stage, int) else stage
    if note:
        return Row(name, stages, (numel,), False, float("inf"), float("inf"), TOL, None, 0, 0, note)
    failing = 0 if ok else (numel if n_failing is None else n_failing)
    return Row(name, stages, (numel,), ok, 0.0 if ok else max_rel / 10, 0.0 if ok else max_rel, TOL,
               None if ok else (0,), failing, numel)


def report(rows: list[Row], hints: dict[str, str] | None = None, notes: list[str] | None = None) -> Report:
    return Report("scaled", rows, hints or {}, "auto", "float32", 4, 4, {}, notes or [], "fx")


def stage_of(layer: int) -> int:
    return 0 if layer < 7 else 1 if layer < 14 else 2 if layer < 20 else 3


LAYERS = [f"layers.{i}" for i in range(26)]
GRADS = ([row(f"grad {layer}.{p}", stage_of(i)) for i, layer in enumerate(LAYERS) for p in ("weight", "bias")]
         + [row(f"grad head.{p}", 3) for p in ("weight", "bias")])


def scaling_bug() -> Report:
    """54 gradient rows fail with one hint; the output and the loss match."""
    rows = [row("output", 3, ok=True), row("loss", 3, ok=True), *GRADS]
    return report(rows, {r.name: SCALING for r in GRADS})


def test_one_hint_over_54_gradient_rows_is_stated_once_in_at_most_40_lines() -> None:
    text = scaling_bug().failure_text()
    assert len(text.splitlines()) <= MAX_LINES
    assert text.count(SCALING) == 1
    assert_expected_inline(text, """\
pipecheck: runner 'scaled' does not match eager (54 of 56 tensors fail; tolerance auto, float32, 4 stages split by fx, 4 micro-batches)
failing rows by kind:  outputs 0 of 1, loss 0 of 1, grads 54 of 54
failing rows by stage: 0: 14 of 14, 1: 14 of 14, 2: 12 of 12, 3: 14 of 16

tensor                 stage  shape  max abs   max rel   tolerance                        worst index  failing
---------------------  -----  -----  --------  --------  -------------------------------  -----------  -------
grad layers.0.weight   0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
  hint (54 rows: grad layers.0.weight ... grad head.bias): gradient scaling: gradient is n_microbatches (=4) times too large; each micro-batch's loss must be divided by n_microbatches
grad layers.0.bias     0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.1.weight   0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.1.bias     0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.2.weight   0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.2.bias     0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.3.weight   0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.3.bias     0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.4.weight   0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.4.bias     0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.5.weight   0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.5.bias     0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.6.weight   0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.6.bias     0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.7.weight   1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.7.bias     1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.8.weight   1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.8.bias     1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.9.weight   1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.9.bias     1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.10.weight  1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.10.bias    1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.11.weight  1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.11.bias    1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.12.weight  1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.12.bias    1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.13.weight  1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.13.bias    1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.14.weight  2      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
grad layers.14.bias    2      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
... 10 rows left out here
grad layers.20.weight  3      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
... 23 of 54 failing rows left out: print(err.report.table()) shows every row""")


def test_table_has_every_row_and_states_the_shared_hint_once() -> None:
    scaled = scaling_bug()
    table = scaled.table()
    lines = table.splitlines()
    assert len(lines) == 2 + len(scaled.rows) + 1  # header, rule, every row, one hint line
    assert [line.split()[0] for line in lines[2:4]] == ["output", "loss"]
    for r in scaled.rows:
        assert sum(line.startswith(r.name + " ") for line in lines) == 1, r.name
    assert lines[5] == f"  hint (54 rows: grad layers.0.weight ... grad head.bias): {SCALING}"
    assert scaled.failure_text(max_lines=None).count(SCALING) == 1
    assert len(scaled.failure_text(max_lines=None).splitlines()) == 2 + 2 + 54 + 1


def test_a_hint_for_one_row_stays_under_it_and_a_shared_one_names_its_rows() -> None:
    rows = [row("output", 1, max_rel=1.0), row("grad a.weight", 0), row("grad b.weight", 1, ok=True),
            row("grad c.weight", 1)]
    hints = {"output": "outputs permuted", "grad a.weight": "tied", "grad c.weight": "tied"}
    assert_expected_inline(report(rows, hints).failure_text(), """\
pipecheck: runner 'scaled' does not match eager (3 of 4 tensors fail; tolerance auto, float32, 4 stages split by fx, 4 micro-batches)

tensor         stage  shape  max abs   max rel   tolerance                        worst index  failing
-------------  -----  -----  --------  --------  -------------------------------  -----------  -------
output         1      (16)   1.00e-01  1.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
  hint: outputs permuted
grad a.weight  0      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16
  hint (2 rows: grad a.weight, grad c.weight): tied
grad c.weight  1      (16)   3.00e-01  3.00e+00  auto: atol 1.0e-06 rtol 2.4e-07  (0)          16/16""")


def test_rows_of_a_hint_that_do_not_follow_each_other_are_named_by_the_first_three() -> None:
    rows = [row(f"grad p{i}", 0) for i in range(6)]
    hints = {r.name: "one cause" for r in rows[::2] + rows[1:2]}
    assert format_table(rows, hints).splitlines()[3] == "  hint (4 rows: grad p0, grad p1, grad p2 and 1 more): one cause"


def test_outputs_loss_each_hint_and_each_stage_are_picked_before_the_worst_of_the_rest() -> None:
    rows = ([row(f"grad s0.{i}", 0, max_rel=9.0) for i in range(10)] + [row("grad s1.0", 1, max_rel=2.0),
            row("grad s1.1", 1, max_rel=1.0), row("grad hinted", 1, max_rel=0.5), row("loss", 1, max_rel=0.1)])
    picked = pick_rows(rows, {"grad hinted": "a hint"}, budget=6)
    # loss (1 line), the hinted row and its hint (2), stage 1's worst (1), then stage 0's worst (2)
    assert [r.name for r in picked] == ["grad s0.0", "grad s0.1", "grad s1.0", "grad hinted", "loss"]


def test_a_row_failing_everywhere_is_worse_than_one_failing_once_at_the_same_max_rel() -> None:
    rows = [row("grad once", 0, n_failing=1), row("grad all", 0)]
    assert [r.name for r in pick_rows(rows, {}, budget=1)] == ["grad all"]


@pytest.mark.parametrize("n_rows", [1, 20, 36, 37, 60, 500])
@pytest.mark.parametrize("n_hints", [0, 1, 3, 50])
def test_the_failure_text_never_passes_max_lines(n_rows: int, n_hints: int) -> None:
    rows = [row(f"grad p{i}", i % 5, max_rel=1.0 + i % 7) for i in range(n_rows)]
    hints = {r.name: f"cause {i % n_hints}" for i, r in enumerate(rows)} if n_hints else {}
    failed = report(rows, hints, notes=["a note on what was not compared"])
    text = failed.failure_text()
    assert len(text.splitlines()) <= MAX_LINES
    assert text.endswith("\nnote: a note on what was not compared")
    shown = [r for r in rows if f"\n{r.name} " in text]
    if len(shown) < n_rows:
        assert f"... {n_rows - len(shown)} of {n_rows} failing rows" in text
    assert str(failed) == text  # print(report) of a long failure is the same cut


def test_hints_without_a_row_that_fits_are_counted_as_left_out() -> None:
    rows = [row(f"grad p{i}", 0) for i in range(40)]
    text = report(rows, {r.name: f"cause {i}" for i, r in enumerate(rows)}).failure_text()
    assert "... 24 of 40 failing rows and 24 hints left out: " in text


def test_a_short_report_prints_every_row_passing_ones_too() -> None:
    rows = [row("output", 1, ok=True), row("loss", 1, ok=True), row("grad w", 0)]
    short = report(rows, {"grad w": "a hint"})
    assert str(short) == short.headline() + "\n\n" + short.table()
    assert "output" not in short.failure_text()


def test_a_long_match_prints_the_first_rows_and_how_to_see_them_all() -> None:
    rows = [row(f"grad p{i}", 0, ok=True) for i in range(100)]
    text = str(report(rows))
    assert len(text.splitlines()) == MAX_LINES
    assert text.splitlines()[-1] == "... 65 of 100 rows left out (all match): print(report.table()) shows every row"
    assert report(rows).text(max_lines=None).count("\ngrad p") == 100


def test_the_command_line_names_its_own_way_to_see_every_row() -> None:
    text = scaling_bug().failure_text(see_all="rerun with -v to see every row")
    assert text.splitlines()[-1] == "... 23 of 54 failing rows left out: rerun with -v to see every row"
