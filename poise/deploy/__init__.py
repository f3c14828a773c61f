"""Engine replicas on Ray Serve behind poise's router (``poise serve --replicas N``).

Ray is an optional extra (``pip install 'poise[scale]'``); it is imported inside functions
only, so that importing this package (and building the CLI) needs neither ray nor torch.
"""
