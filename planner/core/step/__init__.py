"""One training step in time: the schedule's action order, simulated and predicted, and calibrated.

- ``schedules``: every torch 2.13 schedule's per-rank action order and stage placement.
- ``simulate``: one step as discrete events (forward, backward, input and weight gradients, messages).
- ``predict``: a laid-out split timed (``predict``, ``timed``): the step, bubble and imbalance.
- ``calibrate``: factors fitted from a run's measurements, applied to the profiled costs.
"""
