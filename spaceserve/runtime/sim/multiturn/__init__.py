"""The multi-turn workload: workload.py (conversations whose turns resend images and grow a
shared prefix, through the caches), cli.py (`spaceserve sim multiturn`)."""
