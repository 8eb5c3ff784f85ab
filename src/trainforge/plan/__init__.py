"""Plan and advise: a cost model of training layouts (``trainforge plan``) and advice drawn
from a finished run's measurements (``trainforge advise``). ``spec.py`` holds the types every
part shares: a cluster, a workload, a layout and the estimate of one layout."""
