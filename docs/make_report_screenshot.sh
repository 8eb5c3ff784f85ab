#!/usr/bin/env bash
# Regenerates docs/report.png: two short debug runs that differ only in the learning
# rate, their overlaid `trainforge report`, rendered by headless Chromium (Debian:
# apt-get install chromium-headless-shell, or chromium) and shrunk to a small PNG.
# About 1-2 minutes on a laptop CPU. Usage: docs/make_report_screenshot.sh [WORK_DIR]
#   PYTHON=.venv/bin/python  CHROMIUM=chromium  override the tools found on PATH.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
python=${PYTHON:-python}
chromium=${CHROMIUM:-$(command -v chromium-headless-shell || command -v chromium || true)}
[ -n "$chromium" ] || { echo "no chromium-headless-shell or chromium on PATH (apt-get install chromium-headless-shell)" >&2; exit 2; }
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

for run in "lr1e-3 0.001" "lr3e-3 0.003"; do
  set -- $run
  rm -rf "${work:?}/$1"
  "$python" -m trainforge train --model.flavor debug --training.steps 60 --training.lr "$2" \
    --training.warmup_steps 10 --training.val_interval 20 --training.log_interval 5 --no_sample --run_dir "$work/$1"
done
"$python" -m trainforge report "$work/lr1e-3" "$work/lr3e-3" --smooth 0.6 --out "$work/compare.html"
# --screenshot takes the window, not the page: 2560 px tall holds this whole report; the blank
# window below it is cropped.
"$chromium" --headless --no-sandbox --hide-scrollbars --window-size=1280,2560 \
  --screenshot="$work/full.png" "file://$work/compare.html"
"$python" - "$work/full.png" "$repo/docs/report.png" <<'PY'
import sys
from PIL import Image, ImageChops
img = Image.open(sys.argv[1]).convert("RGB")
bbox = ImageChops.difference(img, Image.new("RGB", img.size, "white")).getbbox()
img = img.crop((0, 0, img.width, min(img.height, bbox[3] + 24)))  # the blank window below the page
img = img.resize((img.width * 3 // 4, img.height * 3 // 4), Image.LANCZOS)  # 960 px wide: README width
img.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(sys.argv[2], optimize=True)  # keeps the tab10 hues
PY
echo "wrote $repo/docs/report.png ($(stat -c %s "$repo/docs/report.png") bytes)"
