"""`sitsctl`: the command line of SITS."""
