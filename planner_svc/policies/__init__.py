"""γ policies: the nightjar bandit and the baselines, behind one interface (see base.py)."""

from planner_svc.policies.base import DEFAULT_BUCKETS, Context, Decision, GammaPolicy
from planner_svc.policies.factory import SPECS, make_policy, make_static_policy
from planner_svc.policies.nightjar import NightjarPolicy, NightjarSettings

__all__ = ["DEFAULT_BUCKETS", "OFFLOADED", "RESIDENT", "SPECS", "Context", "Decision", "GammaPolicy",
           "NightjarPolicy", "NightjarSettings", "make_policy", "make_static_policy"]
