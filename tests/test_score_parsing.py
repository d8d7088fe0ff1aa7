"""parse_score on adversarial coach replies: a score comes from the JSON verdict's "score", the designated
`<KEY>: <n>` line, or a reply that is only a number; every other number in prose is not a score. And
parse_review on hindsight replies: a review matches the episode's actions one to one, or there is none."""

import json

import pytest

from openrlhf_mappa.coach import parse_review, parse_score

KEY = "PROCESS_SCORE"

# (reply, expected score or None for a parse error); all with the key PROCESS_SCORE.
CORPUS = [
    # prose full of numbers that are not the score
    ("The F1 score is 0.81 on the validation split, a solid result.", None),
    ("Step 3: the agent fits the model.\nStep 4: it saves model.pkl.", None),
    ("7/10 for the analysis but 3/10 for the code.", None),
    ("I would put this between 6 and 8.", None),
    ("The code fails in **2** places.", None),
    ("The answer is 42.", None),
    ("I rate it 7 out of 10.", None),
    ("Score: 7", None),  # not the designated key
    ("I will give a PROCESS_SCORE of 7 because the code runs.", None),  # the key in prose is no score line
    ("Final verdict - PROCESS_SCORE: 7", None),  # the key must start its line
    ("PROCESS_SCORE_V2: 7", None),
    ("FINAL_PROCESS_SCORE: 7", None),
    ("PROCESS_SCORE:\n7", None),  # the number must be on the key's line
    ("", None),
    # the score line, with what may surround it
    ("The code runs and prints the right sum.\nPROCESS_SCORE: 8", 8.0),
    ("PROCESS_SCORE: 6 \u2014 a flawless action would score 10", 6.0),
    ("PROCESS_SCORE: 6 - a flawless action would score 10", 6.0),
    ("PROCESS_SCORE: 8 (the output matches the reasoning)", 8.0),
    ("PROCESS_SCORE: 7.\nThe rest is commentary with 3 numbers, 4 and 5.", 7.0),
    ("process_score = 5.5", 5.5),
    ("PROCESS_SCORE : 4", 4.0),
    ("PROCESS_SCORE: 7/10", 7.0),
    ("PROCESS_SCORE: 7 / 10.", 7.0),
    ("**PROCESS_SCORE:** 7", 7.0),
    ("**PROCESS_SCORE: 7**", 7.0),
    ("PROCESS_SCORE: **10**", 10.0),
    ("## PROCESS_SCORE: 7", 7.0),
    ("> PROCESS_SCORE: 6", 6.0),
    ("- PROCESS_SCORE: 2", 2.0),
    ("`PROCESS_SCORE: 5`", 5.0),
    ("Good.\r\nPROCESS_SCORE: 9\r\nDone.", 9.0),
    ("PROCESS_SCORE: 0", 0.0),
    ("PROCESS_SCORE: 10", 10.0),
    ("PROCESS_SCORE: <integer from 0 to 10>\nPROCESS_SCORE: 3", 3.0),  # the template's line echoed, then the score
    # malformed numbers, ranges, alternatives, percentages: no score
    ("PROCESS_SCORE: 6-7", None),
    ("PROCESS_SCORE: 6 - 7", None),
    ("PROCESS_SCORE: 6 to 8", None),
    ("PROCESS_SCORE: 7 or 8", None),
    ("PROCESS_SCORE: between 6 and 8", None),
    ("PROCESS_SCORE: 70%", None),
    ("PROCESS_SCORE: 7,5", None),
    ("PROCESS_SCORE: 7/5", None),
    ("PROCESS_SCORE: 7/100", None),
    # out of [0, 10]: a parse error, never a reason to look for another number
    ("PROCESS_SCORE: 11", None),
    ("PROCESS_SCORE: -1", None),
    ("PROCESS_SCORE: 10.5", None),
    ("PROCESS_SCORE: 12, i.e. 8/10", None),
    # several score lines
    ("PROCESS_SCORE: 4\nOn reflection the code is fine.\nPROCESS_SCORE: 7", None),
    ("PROCESS_SCORE: 7\nTo sum up, the action was sound.\nPROCESS_SCORE: 7.0", 7.0),
    ("PROCESS_SCORE: -1\nPROCESS_SCORE: 7", None),
    # the authors' two keys (mathchat.yaml asks the Verifier's coach for both): only PROCESS_SCORE is a score
    ("Sound synthesis.\nPROCESS_SCORE: 7\nANSWER_CORRECT: 1", 7.0),
    ("ANSWER_CORRECT: 1\nPROCESS_SCORE: 3", 3.0),
    ("PROCESS_SCORE: 8\nANSWER_CORRECT: 0 (the reference is 204, the Verifier wrote 240)", 8.0),
    ("The Verifier's \\boxed{204} matches the reference 204.\nANSWER_CORRECT: 1", None),  # the outcome key is no score
    ("PROCESS_SCORE: <integer from 0 to 10>\nANSWER_CORRECT: 1", None),  # the template's line echoed, no score
    ("PROCESS_SCORE: [0 to 10]\nANSWER_CORRECT: 1", None),
    # a reply that is only a number
    ("7", 7.0),
    ("7/10", 7.0),
    ("**7**", 7.0),
    ("7.5", 7.5),
    ("-1", None),
    ("11", None),
    # JSON verdicts
    ('{"rationale": "fine", "score": 9.5}', 9.5),
    ('```json\n{"rationale": "r", "score": 8}\n```', 8.0),
    ('```\n{"score": 3}\n```', 3.0),
    ('{"rationale": "ok", "score": "7"}', None),
    ('{"rationale": "ok", "score": true}', None),
    ('{"rationale": "ok"}', None),
    ('{"rationale": "ok", "score": 12}', None),
    ('{"score": NaN}', None),
    ('{"score": 7.5, "rationale": "PROCESS_SCORE: 2"}', 7.5),  # a JSON verdict is judged by its "score" alone
    ('```json\n```json\n{"score": 8}\n```\n```', None),  # nested fences: not one JSON object
    ('Here is my verdict:\n```json\n{"score": 8}\n```', None),  # prose around JSON: neither JSON nor a key line
    # a reasoning coach: only the verdict after its <think> block counts, never a score weighed inside it
    ("<think>\nAt first sight PROCESS_SCORE: 9.\n</think>\n\nThe code never ran.\nPROCESS_SCORE: 4", 4.0),
    ("<think>\nPROCESS_SCORE: 9 seems fair.\n</think>\n\nThe action is sound.", None),  # its only line is thought
    ("<think>\nPROCESS_SCORE: 9, or PROCESS_SCORE: 6\n</think>\n7", 7.0),
    ("Weighing it: PROCESS_SCORE: 9?\n</think>\nPROCESS_SCORE: 5", 5.0),  # the template opened <think> itself
    ("<think>\nPROCESS_SCORE: 9 at first sight, but", None),  # cut off inside its reasoning: no verdict
    ('<think>\n{"score": 9}\n</think>\n{"rationale": "no check", "score": 3}', 3.0),
    ("<think>a</think>\nPROCESS_SCORE: 2\n<think>b</think>\nPROCESS_SCORE: 8", 8.0),  # after the last block
]


@pytest.mark.parametrize("reply, expected", CORPUS, ids=[repr(r)[1:41] for r, _ in CORPUS])
def test_score_comes_only_from_the_json_verdict_the_key_line_or_a_bare_number(reply, expected):
    assert parse_score(reply, KEY) == expected


@pytest.mark.parametrize("reply, key, expected", [
    ("SCORE: 7", "SCORE", 7.0),
    ("PROCESS_SCORE: 7", "SCORE", None),
    ("**Score**: 6", "SCORE", 6.0),
    ("Grade = 9/10", "GRADE", 9.0),
    ("PROCESS_SCORE: 7", "GRADE", None),
    ("grade: 4\nGRADE: 5", "GRADE", None),
])
def test_the_score_line_key_is_the_one_given(reply, key, expected):
    assert parse_score(reply, key) == expected


def review(entries, responsible=1, **extra):
    return json.dumps({"rationale": "r", "responsible": responsible, "actions": entries, **extra})


def entries(*scores):
    return [{"id": i, "score": s} for i, s in enumerate(scores, 1)]


# Hindsight reviews of a 3-action episode: (reply, expected (scores, responsible index) or None).
REVIEWS = [
    (review(entries(7, 2, 9), responsible=2), ([7.0, 2.0, 9.0], 1)),
    (review(list(reversed(entries(7, 2, 9)))), ([7.0, 2.0, 9.0], 0)),  # entries in any order, matched by id
    ("```json\n" + review(entries(0, 10, 5.5)) + "\n```", ([0.0, 10.0, 5.5], 0)),
    (review([dict(e, why="fine") for e in entries(1, 2, 3)]), ([1.0, 2.0, 3.0], 0)),  # other keys are ignored
    # a wrong count
    (review(entries(7, 2)), None),
    (review(entries(7, 2, 9, 4)), None),
    (review([]), None),
    # duplicate or missing ids
    (review([{"id": 1, "score": 7}, {"id": 1, "score": 2}, {"id": 3, "score": 9}]), None),
    (review([{"id": 1, "score": 7}, {"id": 2, "score": 2}, {"id": 4, "score": 9}]), None),
    (review([{"id": 0, "score": 7}, {"id": 1, "score": 2}, {"id": 2, "score": 9}]), None),  # ids count from 1
    (review([{"score": 7}, {"id": 2, "score": 2}, {"id": 3, "score": 9}]), None),
    (review([{"id": "1", "score": 7}, {"id": 2, "score": 2}, {"id": 3, "score": 9}]), None),
    (review([{"id": 1.0, "score": 7}, {"id": 2, "score": 2}, {"id": 3, "score": 9}]), None),
    (review([{"id": True, "score": 7}, {"id": 2, "score": 2}, {"id": 3, "score": 9}]), None),
    # scores out of range or not numbers
    (review(entries(7, 11, 9)), None),
    (review(entries(7, -0.5, 9)), None),
    (review(entries(7, "8", 9)), None),
    (review(entries(7, None, 9)), None),
    (review(entries(7, True, 9)), None),
    ('{"rationale": "r", "responsible": 1, "actions": [{"id": 1, "score": NaN}, {"id": 2, "score": 1}, {"id": 3, "score": 1}]}', None),
    # the responsible action missing or not one of the ids
    (review(entries(7, 2, 9), responsible=4), None),
    (review(entries(7, 2, 9), responsible=0), None),
    (review(entries(7, 2, 9), responsible=None), None),
    (review(entries(7, 2, 9), responsible="2"), None),
    (json.dumps({"actions": entries(7, 2, 9)}), None),
    # prose, or JSON in prose, or the list alone
    ("Action 1: 7/10. Action 2: 2/10, it broke the chain. Action 3: 9/10.", None),
    ("Here is my review:\n" + review(entries(7, 2, 9)), None),
    (review(entries(7, 2, 9)) + "\nHope this helps.", None),
    (json.dumps(entries(7, 2, 9)), None),
    ("PROCESS_SCORE: 7", None),
    ("7", None),
    ("", None),
    # a reasoning coach's review: the JSON after its <think> block
    ("<think>\nAction 2 broke the chain.\n</think>\n\n" + review(entries(7, 2, 9), responsible=2), ([7.0, 2.0, 9.0], 1)),
    ("<think>\n" + review(entries(7, 2, 9)) + "\n</think>\nAction 2 broke it.", None),
]


@pytest.mark.parametrize("reply, expected", REVIEWS, ids=[repr(r)[1:61] for r, _ in REVIEWS])
def test_a_hindsight_review_matches_the_actions_one_to_one_or_is_no_review(reply, expected):
    parsed = parse_review(reply, 3)
    assert (parsed[:2] if parsed else None) == expected
