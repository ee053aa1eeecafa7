"""The lab that reruns the paper's experiments small (InLine attention, arXiv 2412.06590), run as
`python -m paper COMMAND` from the repository root; paper/__main__.py lists the commands."""
