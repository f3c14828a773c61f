"""How late first tokens have come lately compared with their admission forecast.

Predictive admission compares a forecast of a request's TTFT with its class's target. The
forecast (predictor.py) replays the backlog with the *mean* step cost, so it is an estimate of
the typical TTFT; the target is a 95th percentile, and the steps that make a tail are exactly
those the mean hides: steps that run slower than the fit for a while (a busy machine, the HTTP
loop holding the GIL, garbage collection), and the engine loop's own time between steps. On a
shared 2-core machine the accepted requests' TTFT p95 measured 1.5-3x the bound with the raw
forecast, although the forecast's median was right.

So admission learns the error it makes: for every accepted request whose first token came, the
ratio of its actual TTFT to the forecast made when it was admitted; the forecast of a new
request is multiplied by the 95th percentile of the recent ratios (never by less than 1: a
forecast that errs late is not loosened). A request admitted when the forecast says it meets
the target with that factor then meets it in about 95 % of cases, whatever the machine does,
as long as the recent past looks like the near future. Only recent samples count (a time
window and a count), so a slow spell that ends stops costing admissions soon after; while the
factor is large, only requests with a short forecast (a short queue) are taken, and their
first tokens refresh the samples.

Pure Python and clock-free: times come in from the caller.
"""

from __future__ import annotations

from collections import deque

# The percentile the class targets name (ttft_p95_ms).
QUANTILE = 0.95
# Samples older than this (s) no longer count: long enough to hold a few hundred requests at
# the rates a CPU serves, short enough to forget a slow spell within seconds.
WINDOW_S = 5.0
MAX_SAMPLES = 512
# Fewer recent samples than this: no correction. With few samples the 95th percentile is
# their largest, which errs on the side of refusing: a server that just started, with a
# step-cost prior twice too fast, admitted a burst it could not serve in time while it waited
# for 20 samples.
MIN_SAMPLES = 3


class TtftCalibration:
    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (time, ratio)

    def observe(self, predicted_s: float, actual_s: float, now: float, floor_s: float) -> None:
        """A first token ``actual_s`` after arrival, for a request admitted with the forecast
        ``predicted_s``; ``floor_s`` (one step) keeps a near-zero forecast from making a huge
        ratio out of an ordinary step."""
        self._samples.append((now, max(0.0, actual_s) / max(predicted_s, floor_s, 1e-9)))

    def factor(self, now: float) -> float:
        """What to multiply a forecast by: the recent ratios' 95th percentile, at least 1."""
        while self._samples and self._samples[0][0] < now - WINDOW_S:
            self._samples.popleft()
        if len(self._samples) < MIN_SAMPLES:
            return 1.0
        ratios = sorted(ratio for _, ratio in self._samples)
        return max(1.0, ratios[min(len(ratios) - 1, int(QUANTILE * len(ratios)))])
