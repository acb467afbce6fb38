"""Reward of the built-in synthetic tasks (data/synthetic.py).

1.0   the response is exactly the answer (then end-of-sequence): a success, for pilot selection
      (rollout.pilot.success_threshold 1.0);
0.5   it starts with the right digit but goes on;
0.1   it starts with a wrong digit (format credit, so a random model gets a signal at once; a
      wrong letter for countdown's letter answers);
0.0   anything else.

A longer answer (long_tail: "777", n = len(answer) >= 2) is scored by how much of it is matched
and how close to its length the response stops: with p = the length of the response's common
prefix with the answer and L = len(response), 0.1 + 0.2 * p / n + 0.2 * p / max(L, n) once the
first character is right. So with answer "7777": "7" 0.2, "77" 0.3, "777" 0.4, "77777" 0.46,
"7" * 48 0.32, "7377" 0.2, "3777" 0.1, "" or "x" 0.0. Both terms give a random-init policy, whose
responses run on, a signal from the first step: repeating the digit raises p, and stopping sooner
raises the second term. (Counting the characters past the answer's end against the match instead
gave a policy whose responses run to max_new_tokens the same reward for "7" + junk as for the
whole answer + junk: no signal but the first digit, and random-init runs sat at "any digit",
reward 0.10, for 200 steps.) Partial credit stays below 0.5, so every 1.0 is an exact answer.
A one-character answer (the other tasks, long_tail with n = 1) keeps the rule above.
"""


def _same_kind(first: str, answer: str) -> bool:
    """Format credit: the response starts with a character of the answer's kind (a digit for the
    digit tasks, a letter for countdown and reverse)."""
    return first.isdigit() if answer[:1].isdigit() else (first.isalpha() and first.isascii())


def compute_score(response: str, answer: str) -> float:
    text = response.strip()
    if text == answer:
        return 1.0
    n = len(answer)
    if n <= 1:  # the one-digit tasks, unchanged
        if text[:1] == answer:
            return 0.5
        return 0.1 if _same_kind(text[:1], answer) else 0.0
    prefix = 0
    for a, b in zip(text, answer):
        if a != b:
            break
        prefix += 1
    if prefix == 0:
        return 0.1 if _same_kind(text[:1], answer) else 0.0
    return 0.1 + 0.2 * prefix / n + 0.2 * prefix / max(len(text), n)


def is_success(response: str, answer: str) -> bool:
    """The binary notion pilot selection uses: the response is exactly the answer (score 1.0)."""
    return compute_score(response, answer) == 1.0


def exact_score(response: str, answer: str) -> float:
    """reward.name exact: 1.0 for exactly the answer (surrounding whitespace aside), else 0.0 - the
    binary verifiable reward of the allocation papers (no partial credit, so a group of one
    verdict carries no GRPO gradient)."""
    return 1.0 if response.strip() == answer else 0.0
