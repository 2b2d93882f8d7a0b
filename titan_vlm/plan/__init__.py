"""Price a parallel layout before running it: `python -m titan_vlm.plan` (see __main__.py).

shapes.py reads the model; spec.py the layout and workload; memory.py, comm.py and cost.py
price them; hardware.py is the table of devices; search.py lists the layouts that fit.
"""
