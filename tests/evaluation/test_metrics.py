"""Unit tests of videosft.evaluation.metrics: the official QVHighlights numbers, then hand-computed cases."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from videosft.evaluation.metrics import QVHIGHLIGHTS_IOU_THRESHOLDS, average_precision, mean_average_precision, qvhighlights_moment_retrieval, recall_at_1, temporal_iou, window_metrics

QVH_DIR = Path(os.environ.get("VIDEOSFT_QVHIGHLIGHTS_DIR", "/work/shared/data/qvhighlights"))
BUCKETS = ("full", "long", "middle", "short")

# --------------------------------------------------------------------------------------------
# the official evaluation's output on its sample predictions


def _read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def official():
    if not (QVH_DIR / "sample_val_preds_metrics_raw.json").exists():
        pytest.skip(f"QVHighlights reference files not found in {QVH_DIR}")
    ours = qvhighlights_moment_retrieval(
        _read_jsonl(QVH_DIR / "sample_val_preds.jsonl"),
        _read_jsonl(QVH_DIR / "highlight_val_release.jsonl"),
    )
    expected = json.loads((QVH_DIR / "sample_val_preds_metrics_raw.json").read_text())
    return ours, expected


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("metric", ["MR-mAP", "MR-R1"])
def test_reproduces_official_bucket(official, bucket, metric):
    ours, expected = official
    want = expected[bucket][metric]
    got = ours[bucket][metric]
    assert set(got) == set(want)
    mismatches = {k: (got[k], v) for k, v in want.items() if round(got[k], 2) != round(v, 2)}
    assert not mismatches, mismatches


def test_reproduces_official_brief(official):
    ours, expected = official
    want = {k: v for k, v in expected["brief"].items() if k.startswith("MR-")}
    assert set(ours["brief"]) == set(want)
    mismatches = {k: (ours["brief"][k], v) for k, v in want.items() if round(ours["brief"][k], 2) != round(v, 2)}
    assert not mismatches, mismatches


# --------------------------------------------------------------------------------------------
# temporal_iou


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((0, 1), (2, 3), 0.0),  # disjoint
        ((0, 2), (2, 4), 0.0),  # touching: a shared instant has no length
        ((0, 10), (2, 4), 0.2),  # nested
        ((1.5, 3.5), (1.5, 3.5), 1.0),  # identical
        ((0, 4), (2, 6), 2 / 6),  # partial overlap
        ((0, 10, 0.9), (5, 10), 0.5),  # a trailing score is ignored
        ((3, 3), (0, 10), 0.0),  # zero length
        ((3, 3), (3, 3), 0.0),  # both zero length: no division by zero
        ((8, 2), (0, 10), 0.0),  # end before start: malformed, overlaps nothing
    ],
)
def test_temporal_iou(a, b, expected):
    assert temporal_iou(a, b) == pytest.approx(expected)
    assert temporal_iou(b, a) == pytest.approx(expected)


# --------------------------------------------------------------------------------------------
# average_precision / mean_average_precision


def test_ap_hit_at_rank_two():
    assert average_precision([(20, 30), (0, 10)], [(0, 10)], 0.5) == pytest.approx(0.5)


def test_ap_two_targets():
    # hits at ranks 1 and 3: precisions 1 and 2/3, each worth half the recall
    ranked = [(0, 10), (50, 60), (20, 30)]
    assert average_precision(ranked, [(0, 10), (20, 30)], 0.5) == pytest.approx((1 + 2 / 3) / 2)


def test_ap_uses_interpolated_precision():
    # hits at ranks 2 and 3: raw precisions 1/2 and 2/3, envelope lifts the first to 2/3
    ranked = [(50, 60), (0, 10), (20, 30)]
    assert average_precision(ranked, [(0, 10), (20, 30)], 0.5) == pytest.approx(2 / 3)


def test_ap_target_matched_once():
    # the duplicate of a hit is a false positive
    assert average_precision([(0, 10), (0, 10)], [(0, 10)], 0.5) == pytest.approx(1.0)
    ranked = [(0, 10), (0, 10), (20, 30)]
    assert average_precision(ranked, [(0, 10), (20, 30)], 0.5) == pytest.approx((1 + 2 / 3) / 2)


def test_ap_prediction_claims_next_best_target_when_best_is_taken():
    # the second prediction overlaps both targets; its best (0, 10) is taken, so it gets (8, 20)
    ranked = [(0, 10), (2, 12)]
    targets = [(0, 10), (8, 20)]
    assert temporal_iou((2, 12), (8, 20)) == pytest.approx(4 / 18)
    assert average_precision(ranked, targets, 0.2) == pytest.approx(1.0)
    assert average_precision(ranked, targets, 0.5) == pytest.approx(0.5)


def test_ap_threshold_is_inclusive():
    assert average_precision([(0, 5)], [(0, 10)], 0.5) == pytest.approx(1.0)
    assert average_precision([(0, 5)], [(0, 10)], 0.55) == 0.0


def test_ap_empty_inputs():
    assert average_precision([], [(0, 10)], 0.5) == 0.0
    assert average_precision([(0, 10)], [], 0.5) == 0.0


def test_mean_average_precision_averages_per_query_and_ranks_by_score():
    predictions = {
        "a": [(0, 10, 0.9), (40, 50, 0.1)],  # AP 1
        "b": [(0, 10, 0.2), (20, 30, 0.9)],  # score puts the miss first: AP 1/2
    }
    ground_truth = {"a": [(0, 10)], "b": [(0, 10)]}
    result = mean_average_precision(predictions, ground_truth, thresholds=[0.5, 0.9])
    assert result == pytest.approx({0.5: 75.0, 0.9: 75.0, "average": 75.0})


def test_mean_average_precision_truncates_before_ranking():
    # only the first submitted window survives max_predictions=1, whatever the scores say
    predictions = {"a": [(20, 30, 0.1), (0, 10, 0.9)]}
    ground_truth = {"a": [(0, 10)]}
    assert mean_average_precision(predictions, ground_truth, [0.5], max_predictions=1)[0.5] == 0.0
    assert mean_average_precision(predictions, ground_truth, [0.5], max_predictions=2)[0.5] == 100.0


def test_mean_average_precision_average_over_thresholds():
    # IoU 0.6: a hit at 0.5, 0.55 and 0.6 (rounded thresholds, so 0.6 passes), a miss above
    predictions = {"a": [(0, 6, 1.0)]}
    result = mean_average_precision(predictions, {"a": [(0, 10)]})
    assert [result[t] for t in QVHIGHLIGHTS_IOU_THRESHOLDS] == [100.0] * 3 + [0.0] * 7
    assert result["average"] == pytest.approx(30.0)


# --------------------------------------------------------------------------------------------
# recall_at_1


def test_recall_at_1():
    predictions = {
        "hit_second_gt": [(20, 30, 0.9)],  # IoU 1 with the second GT window
        "half": [(0, 5, 0.9)],  # IoU 0.5
        "miss": [(50, 60, 0.9)],
        "hit_too_late": [(50, 60, 0.9), (0, 10, 0.8)],  # only the top-1 counts
    }
    ground_truth = {
        "hit_second_gt": [(0, 10), (20, 30)],
        "half": [(0, 10)],
        "miss": [(0, 10)],
        "hit_too_late": [(0, 10)],
    }
    assert recall_at_1(predictions, ground_truth, [0.5, 0.7]) == pytest.approx({0.5: 50.0, 0.7: 25.0})


def test_recall_at_1_top1_is_first_listed_not_best_scored():
    predictions = {"a": [(50, 60, 0.1), (0, 10, 0.9)]}
    assert recall_at_1(predictions, {"a": [(0, 10)]}, [0.5]) == {0.5: 0.0}


# --------------------------------------------------------------------------------------------
# qvhighlights_moment_retrieval on a toy submission


def test_qvhighlights_buckets_and_keys():
    gt_rows = [
        {"qid": 1, "relevant_windows": [[0, 10], [20, 60]]},  # short (length 10 is short) and long
        {"qid": 2, "relevant_windows": [[0, 20]]},  # middle
    ]
    pred_rows = [
        {"qid": 1, "pred_relevant_windows": [[20, 60, 0.9], [0, 10, 0.5]]},
        {"qid": 2, "pred_relevant_windows": [[40, 60, 0.9]]},
    ]
    result = qvhighlights_moment_retrieval(pred_rows, gt_rows)
    assert set(result) == {"brief", "full", "short", "middle", "long"}
    expected_keys = {"0.5", "0.55", "0.6", "0.65", "0.7", "0.75", "0.8", "0.85", "0.9", "0.95"}
    assert set(result["full"]["MR-R1"]) == expected_keys
    assert set(result["full"]["MR-mAP"]) == expected_keys | {"average"}
    assert result["full"]["MR-R1"]["0.5"] == 50.0  # query 1 right, query 2 wrong
    assert result["full"]["MR-mAP"]["average"] == 50.0  # AP 1 and 0
    assert result["long"]["MR-R1"]["0.95"] == 100.0  # only query 1, judged on (20, 60)
    assert result["short"]["MR-R1"]["0.5"] == 0.0  # only query 1, judged on (0, 10)
    assert result["short"]["MR-mAP"]["0.5"] == 50.0  # its hit comes second
    assert result["middle"]["MR-mAP"]["average"] == 0.0
    assert result["brief"] == {
        "MR-full-R1@0.5": 50.0,
        "MR-full-R1@0.7": 50.0,
        "MR-full-mAP": 50.0,
        "MR-full-mAP@0.5": 50.0,
        "MR-full-mAP@0.75": 50.0,
        "MR-long-mAP": 100.0,
        "MR-middle-mAP": 0.0,
        "MR-short-mAP": 50.0,
    }


# --------------------------------------------------------------------------------------------
# window_metrics


def test_window_metrics_perfect_and_partial():
    samples = [
        {"predicted": [(0, 10)], "target": [(0, 10)]},  # IoU 1
        {"predicted": [(0, 6), (0, 10)], "target": [(0, 10)]},  # top-1 IoU 0.6
    ]
    result = window_metrics(samples)
    assert result["num_samples"] == 2
    assert result["R1@0.3"] == pytest.approx(1.0)
    assert result["R1@0.5"] == pytest.approx(1.0)
    assert result["R1@0.7"] == pytest.approx(0.5)
    assert result["mIoU"] == pytest.approx(0.8)
    # second sample: (0, 6) hits up to IoU 0.6 (AP 1); above, (0, 10) hits at rank 2 (AP 1/2)
    second_map = (3 * 1.0 + 7 * 0.5) / 10
    assert result["mAP"] == pytest.approx((1.0 + second_map) / 2)


def test_window_metrics_miou_uses_best_matching_target():
    samples = [{"predicted": [(20, 25)], "target": [(0, 10), (20, 30)]}]
    assert window_metrics(samples)["mIoU"] == pytest.approx(0.5)


def test_window_metrics_unparseable_scores_zero():
    samples = [
        {"predicted": None, "target": [(0, 10)]},
        {"predicted": None, "target": []},  # nor right on a window with nothing to find
        {"predicted": [(0, 10)], "target": [(0, 10)]},
    ]
    result = window_metrics(samples)
    assert (result["num_samples"], result["moment_windows"], result["empty_windows"]) == (3, 2, 1)
    for name in ("R1@0.3", "R1@0.5", "R1@0.7", "mIoU", "mAP"):
        assert result[name] == pytest.approx(1 / 2), name
    assert result["empty_accuracy"] == 0.0 and result["false_keep_rate"] == 0.0


def test_windows_with_nothing_to_keep_are_scored_apart():
    correct = window_metrics([{"predicted": [], "target": []}])
    wrong = window_metrics([{"predicted": [(0, 5)], "target": []}])
    assert (correct["empty_accuracy"], correct["false_keep_rate"]) == (1.0, 0.0)
    assert (wrong["empty_accuracy"], wrong["false_keep_rate"]) == (0.0, 1.0)
    assert all(correct[name] is None and wrong[name] is None for name in ("R1@0.5", "mIoU", "mAP"))


def test_always_answering_none_scores_nothing_on_moments():
    """Half the windows empty: "none" everywhere used to score R1@0.7 = mIoU = 0.5."""
    samples = [{"predicted": [], "target": [(0, 4)]}, {"predicted": [], "target": []}] * 5
    result = window_metrics(samples)
    assert result["R1@0.7"] == result["mIoU"] == result["mAP"] == 0.0
    assert result["empty_accuracy"] == 1.0 and (result["moment_windows"], result["empty_windows"]) == (5, 5)


def test_r1_takes_the_official_iou_to_the_last_bit():
    """The official R1 divides by the hull, in float64, in its order: with one-decimal answers the
    rounding decides thresholds ([1.6, 44.8] vs [0, 48] is 0.8999999999999999 there, 0.9 by union)."""
    from videosft.evaluation.metrics import r1_iou

    assert r1_iou((1.6, 44.8), [(0.0, 48.0)]) == 0.8999999999999999
    assert temporal_iou((1.6, 44.8), (0.0, 48.0)) == 0.9
    predictions = {"q": [(1.6, 44.8, 1.0)]}
    assert recall_at_1(predictions, {"q": [(0.0, 48.0)]}, [0.9]) == {0.9: 0.0}
    # the target is chosen by IoU (first of equals), then scored by the hull
    assert r1_iou((2, 4), [(10, 12), (1, 4), (2, 5)]) == 2 / 3
    assert r1_iou((2, 4), []) == 0.0


def test_window_metrics_empty_prediction_with_target_scores_zero():
    result = window_metrics([{"predicted": [], "target": [(0, 10)]}])
    assert all(result[name] == 0.0 for name in ("R1@0.3", "R1@0.5", "R1@0.7", "mIoU", "mAP"))


def test_window_metrics_thresholds_are_inclusive():
    result = window_metrics([{"predicted": [(0, 3)], "target": [(0, 10)]}])  # IoU 0.3
    assert (result["R1@0.3"], result["R1@0.5"]) == (1.0, 0.0)


def test_window_metrics_no_samples():
    with pytest.raises(ValueError):
        window_metrics([])


def test_lenient_reading_of_prose_answers():
    from videosft.encoding.chat import parse_answer, parse_answer_lenient

    cases = {
        "1.5-3.0, 4.5-7.5": [(1.5, 3.0), (4.5, 7.5)],
        "The ball is visible from 1.5 to 3.0 seconds.": [(1.5, 3.0)],
        "1.5s - 3.0s": [(1.5, 3.0)],
        "0:01.5 - 1:03": [(1.5, 63.0)],
        "3.0-1.5": [(1.5, 3.0)],  # reversed
        "Never.": [],
        "2.4, 3.4": None,  # times, not ranges
        "I cannot tell": None,
    }
    for text, expected in cases.items():
        assert parse_answer_lenient(text) == expected, text
    assert parse_answer("The ball is visible from 1.5 to 3.0 seconds.") is None  # the fine-tune's reading is strict


def test_constant_baselines_are_what_ignoring_the_video_scores():
    from videosft.evaluation.answers import constant_baselines

    rows = [{"keep_local": [[2.0, 6.0]], "window_start": 0.0, "window_end": 8.0},
            {"keep_local": [[3.0, 5.0]], "window_start": 8.0, "window_end": 16.0},
            {"keep_local": [[3.0, 5.0]], "window_start": 24.0, "window_end": 32.0},
            {"keep_local": [], "window_start": 16.0, "window_end": 24.0}]
    baselines = constant_baselines(rows)
    assert baselines["none"]["mIoU"] == 0.0 and baselines["none"]["empty_accuracy"] == 1.0
    assert baselines["whole_window"]["mIoU"] == pytest.approx((4 / 8 + 2 / 8 + 2 / 8) / 3)
    best = baselines["best_constant_range"]
    assert best["range"] == [3.0, 5.0] and best["mIoU"] == pytest.approx((2 / 4 + 1 + 1) / 3)  # the grid's best
    assert best["mIoU"] >= baselines["whole_window"]["mIoU"] and best["false_keep_rate"] == 1.0


def test_the_gain_over_the_best_constant_is_per_window_with_its_standard_error():
    from videosft.evaluation.answers import constant_baselines, gain_over_best_constant, score, table

    rows = [{"keep_local": [[2.0, 6.0]], "window_start": 0.0, "window_end": 8.0},
            {"keep_local": [[3.0, 5.0]], "window_start": 8.0, "window_end": 16.0},
            {"keep_local": [[3.0, 5.0]], "window_start": 24.0, "window_end": 32.0},
            {"keep_local": [], "window_start": 16.0, "window_end": 24.0}]
    baselines = constant_baselines(rows)  # the best: "3.0-5.0", IoU 0.5, 1, 1 on the windows with a moment
    answers = [{"predicted": [(2.0, 6.0)], "target": [(2.0, 6.0)], "window": (0.0, 8.0)},     # IoU 1
               {"predicted": None, "target": [(3.0, 5.0)], "window": (8.0, 16.0)},          # unparseable: 0
               {"predicted": [(3.0, 4.0)], "target": [(3.0, 5.0)], "window": (24.0, 32.0)},  # IoU 0.5
               {"predicted": [], "target": [], "window": (16.0, 24.0)}]                      # no moment: left out
    answers = [{**answer, "lenient": answer["predicted"], "degenerate": False} for answer in answers]
    gain = gain_over_best_constant(answers, baselines)
    gains = [1 - 0.5, 0 - 1, 0.5 - 1]
    mean = sum(gains) / 3
    error = (sum((g - mean) ** 2 for g in gains) / 2) ** 0.5 / 3 ** 0.5
    assert gain == {"constant": "best_constant_range", "mean": pytest.approx(mean),
                    "standard_error": pytest.approx(error), "windows": 3}
    assert gain["mean"] == pytest.approx(score(answers)["mIoU"] - baselines["best_constant_range"]["mIoU"])
    assert f"(3): {mean:+.3f} +- {error:.3f} standard error" in table(
        {"base": score(answers), "fine_tuned": score(answers), "baselines": baselines, "gain_over_best_constant": gain})
    assert gain_over_best_constant([answers[-1]], baselines) is None  # nothing to keep anywhere


def test_the_verify_table_keeps_its_column_names_apart():
    from videosft.evaluation.answers import table

    metrics = {"moment_windows": 3, "empty_windows": 1, "mIoU": 0.5, "R1@0.5": 0.25}
    result = {"base": metrics, "fine_tuned": metrics,
              "baselines": {"none": metrics, "whole_window": metrics, "best_constant_range": {**metrics, "range": [0, 7]}}}
    header = table(result).splitlines()[1]
    assert header.split() == ["metric", "base", "fine-tuned", "const", "none", "const", "whole_window", "const",
                              "best_constant_range"]
    assert all(len(row) == len(header) for row in table(result).splitlines()[2:4])  # values under their names


def test_the_source_time_headline_states_its_scores_as_computed():
    from videosft.evaluation.metrics import source_time_headline, source_time_metrics

    # one video: the cut keeps 2-6 s and 10-12 s of a video whose moments to keep are 2-5 s and 20-22 s
    evaluation = source_time_metrics({"a": [(2.0, 6.0), (10.0, 12.0)]}, {"a": [(2.0, 5.0), (20.0, 22.0)]})
    assert source_time_headline(evaluation) == (
        "in source time, against the annotations of 1 video (2 moments to keep): R1@0.5 0.500, mIoU 0.375, "
        "keep precision 0.500, keep recall 0.600")
    assert source_time_headline(source_time_metrics({"a": []}, {"a": []})).endswith(
        "R1@0.5 -, mIoU -, keep precision -, keep recall -")  # nothing counts: no number
