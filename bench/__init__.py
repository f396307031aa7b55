"""Benchmarks: each module is a script run from the project's root as `python -m bench.NAME`
(`make bench` runs them all), printing its figures with a JSON line last. Run as modules, they
import the project's packages and each other by their full names, and none of them shadows a
package it measures (`bench.dispatch` is not `dispatch`)."""
