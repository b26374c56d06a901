"""Adaptive k: choose k per request so that speculation never costs more than it gains.

Each request's acceptance of each draft kind is counted (``acceptance``); each pass a step can need is timed
once per setup (``calibration``, cached on disk by ``cache``) into a cost model (``costs``); the planner weighs
every request's options together for the most expected tokens per second of the whole step (``planner``); and
``AdaptiveK`` (``policy``) runs this for a proposer, keeping what it learns about each request in the request's
``SpecState``. k = 0 (plain decoding) wins whenever drafts are too slow or too often wrong for this batch.
"""
from specdecode.speculative.adaptive.acceptance import PROBE_EVERY, Acceptance, ConfidenceRates
from specdecode.speculative.adaptive.cache import cached_calibration, calibration_key
from specdecode.speculative.adaptive.calibration import calibrate, calibration_rows, draft_calibration_rows
from specdecode.speculative.adaptive.costs import CostModel, expected_tokens
from specdecode.speculative.adaptive.planner import PLAIN, StepCosts, StepOption, choose_k, next_k, plan_step
from specdecode.speculative.adaptive.policy import AdaptiveK, prefix_length

__all__ = ["PLAIN", "PROBE_EVERY", "Acceptance", "AdaptiveK", "ConfidenceRates", "CostModel", "StepCosts",
           "StepOption", "cached_calibration", "calibrate", "calibration_key", "calibration_rows", "choose_k",
           "draft_calibration_rows", "expected_tokens", "next_k", "plan_step", "prefix_length"]
