"""Non-negative least squares (Lawson-Hanson), the calibration's solver: stage costs cannot be
negative. numpy only, imported when called."""
from __future__ import annotations


def nnls(A, b, max_iter: int = 500):
    """min ||A x - b|| subject to x >= 0 (Lawson-Hanson), columns scaled to unit norm first."""
    import numpy as np
    A, b = np.asarray(A, float), np.asarray(b, float)
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    As = A / scale
    n = As.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    w = As.T @ (b - As @ x)
    it = 0
    while (~passive).any() and w[~passive].max() > 1e-12 and it < max_iter:
        it += 1
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(As[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
        w = As.T @ (b - As @ x)
    return x / scale
