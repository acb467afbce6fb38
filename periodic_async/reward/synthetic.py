"""Reward of the built-in synthetic tasks (data/synthetic.py).

1.0   the response is exactly the answer (then end-of-sequence): a success, for pilot selection
      (rollout.pilot.success_threshold 1.0);
0.5   it starts with the right digit but goes on;
0.1   it starts with a wrong digit (format credit, so a random model gets a signal at once);
0.0   anything else.

A longer answer (long_tail: "777") generalises the middle two by how much of it is matched:
0.1 + 0.4 * m / n, where n = len(answer), m = the length of the response's common prefix with the
answer minus the characters it runs past the answer's end, at least 1 once the first character is
right. So with answer "7777": "77" 0.3, "777" 0.4, "77777" 0.4, "7777777" 0.2, "7377" 0.2, "3777"
0.1, "" or "x" 0.0. Running on is as costly as stopping early, and both approach 0.5 near the
right length. For a one-character answer (the other tasks) this is exactly the rule above.
"""


def compute_score(response: str, answer: str) -> float:
    text = response.strip()
    if text == answer:
        return 1.0
    n = len(answer)
    if n <= 1:  # the one-digit tasks, unchanged
        if text[:1] == answer:
            return 0.5
        if text[:1].isdigit():
            return 0.1
        return 0.0
    prefix = 0
    for a, b in zip(text, answer):
        if a != b:
            break
        prefix += 1
    if prefix == 0:
        return 0.1 if text[:1].isdigit() else 0.0
    matched = max(1, prefix - max(0, len(text) - n))
    return 0.1 + 0.4 * matched / n


def is_success(response: str, answer: str) -> bool:
    """The binary notion pilot selection uses: the response is exactly the answer (score 1.0)."""
    return compute_score(response, answer) == 1.0
