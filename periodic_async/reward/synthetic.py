"""Reward of the built-in synthetic task (data/synthetic.py).

1.0   the response is exactly the answer digit (then end-of-sequence);
0.5   it starts with the right digit but goes on;
0.1   it starts with a wrong digit (format credit, so a random model gets a signal at once);
0.0   anything else.
"""


def compute_score(response: str, answer: str) -> float:
    text = response.strip()
    if text == answer:
        return 1.0
    if text[:1] == answer:
        return 0.5
    if text[:1].isdigit():
        return 0.1
    return 0.0

