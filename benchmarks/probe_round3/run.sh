#!/bin/bash
python keep_training.py
