"""The building blocks a study's own page shares with the generic one: a cell's interval in one call, the seeds a
cell has, a method against the others paired over seeds, and a curve with its band."""

import math

from lightning_fedhet.experiments import (
    band,
    fmt_mean_ci,
    mean_ci,
    new_figure,
    paired_differences,
    provenance_table,
    seeds_done,
)


def test_a_cells_interval_and_its_seeds():
    assert fmt_mean_ci([0.50, 0.52, 0.54]) == "52.0 [47.0, 57.0]"
    assert fmt_mean_ci([3.0], scale=1.0, digits=0, unit=" s") == "3 s"
    assert (seeds_done(7, 10), seeds_done(10, 10), seeds_done(11, 10)) == ("7/10 (incomplete)", "10/10", "11/10")


def test_paired_differences_table_counts_the_seeds_ahead_over_the_common_seeds():
    values = {"A": {0: 0.6, 1: 0.5, 2: 0.7}, "B": {0: 0.5, 1: 0.55, 2: 0.6}, "C": {0: 0.4, 1: 0.45}}
    table, diffs = paired_differences(values, "A", ["B", "C"])
    assert table.splitlines()[0] == "| difference | mean [95 % CI] | seeds | seeds A ahead |"
    # A - B: 0.1, -0.05, 0.1; mean 0.05, s = 0.0866, half-width t_{0.975,2} s / sqrt(3) = 0.215
    assert "| A − B | 5.0 pp [-16.5, 26.5] | 3 | 2/3 |" in table
    mean, lo, hi, n = diffs["C"]  # over the two seeds C ran
    assert n == 2 and math.isclose(mean, 0.125) and "| A − C | 12.5 pp [-82.8, 107.8] | 2 | 2/2 |" in table


def test_band_draws_the_mean_and_a_band_only_from_two_seeds():
    fig, (ax,) = new_figure()
    band(ax, [1, 2], [[0.5, 0.6], [0.7, 0.8]], "A (2)", lw=1.3)
    band(ax, [1, 2], [[0.5, 0.6]], "B (1)")
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["A (2)", "B (1)"]
    assert list(lines[0].get_ydata()) == [mean_ci([50.0, 70.0])[0], mean_ci([60.0, 80.0])[0]]
    assert len(ax.collections) == 1  # one band: a single seed has no interval



def test_figure_title_wraps_to_the_figures_width(tmp_path):
    # a 5-inch figure at 9 pt: lines of at most 14 * 5 = 70 characters; at 18 pt half as many (35)
    from lightning_fedhet.experiments import figure_title, save_figure

    title = "CA-Fed study, protocol v3: test accuracy, mean and 95 % CI over seeds (n in legend)"  # 84 characters
    fig, _ = new_figure(width=5.0)
    figure_title(fig, title)
    lines = fig.get_suptitle().split("\n")
    assert len(lines) == 2 and max(map(len, lines)) <= 70 and " ".join(lines) == title
    figure_title(fig, title, fontsize=18)
    assert max(map(len, fig.get_suptitle().split("\n"))) <= 35
    save_figure(fig, tmp_path / "title.png")
    assert (tmp_path / "title.png").stat().st_size > 0


def test_provenance_rows_split_by_processor_and_name_records_without_one():
    # Slip it catches: a page that pools runs of two processors (whose re-runs differ) into one provenance row.
    def rec(cpu, wall):
        r = {"protocol": "v1", "commit": "abc", "dirty": False, "engine": "vmap", "device": "cpu (2 cores, x86_64)",
             "torch": "2.14", "wall_s": wall}
        return r if cpu is None else {**r, "cpu": cpu}

    rows = provenance_table([rec("AMD EPYC; AVX512", 60), rec("AMD EPYC; AVX512", 30), rec("Intel; AVX512", 120),
                             rec(None, 6)]).splitlines()
    assert rows[0] == "| protocol | commit | engine | device | processor | torch | runs | wall min |"
    assert rows[2:] == ["| v1 | abc | vmap | cpu (2 cores, x86_64) | AMD EPYC; AVX512 | 2.14 | 2 | 1.5 |",
                        "| v1 | abc | vmap | cpu (2 cores, x86_64) | Intel; AVX512 | 2.14 | 1 | 2.0 |",
                        "| v1 | abc | vmap | cpu (2 cores, x86_64) | not recorded | 2.14 | 1 | 0.1 |"]


def test_provenance_rows_pool_a_commit_named_whole_with_its_abbreviation():
    # Slip it catches: a record imported with the whole 40-character hash (a GPU machine has no git and is told the
    # commit) gets a row of its own, beside the 10-character abbreviation git writes for the same commit.
    whole = "d0b76c9240ab3844d6e3dcf99ddaa438b0eba5fb"
    rec = {"protocol": "v2", "dirty": False, "engine": "vmap", "device": "cuda", "cpu": "x", "torch": "2.11",
           "wall_s": 60}
    rows = provenance_table([{**rec, "commit": whole}, {**rec, "commit": "d0b76c9240"},
                             {**rec, "commit": whole, "dirty": True}, {**rec, "commit": "unknown"}]).splitlines()
    assert rows[2:] == ["| v2 | d0b76c9240 | vmap | cuda | x | 2.11 | 2 | 2.0 |",
                        "| v2 | d0b76c9240+dirty | vmap | cuda | x | 2.11 | 1 | 1.0 |",
                        "| v2 | unknown | vmap | cuda | x | 2.11 | 1 | 1.0 |"]
