#!/usr/bin/env bash
# Makes data/kjv-genesis-exodus.txt, the text the char-level language model trains on:
# Genesis and Exodus of the King James Version (1611, public domain), one verse per line,
# chapter headings kept, verse numbers dropped. Source: Debian's bible-kjv 4.38 packages
# (the text and its retrieval program); run once, the result is committed.
set -euo pipefail
out="$(cd "$(dirname "$0")" && pwd)/kjv-genesis-exodus.txt"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
apt-get download bible-kjv bible-kjv-text
for deb in *.deb; do dpkg-deb -x "$deb" root; done
cd root/usr/lib
../bin/bible -p . 'Gen1:1-50:26' 'Exo1:1-40:38' | python3 -c '
import re, sys
verses, current = [], None
for line in sys.stdin:
    line = line.rstrip("\n")
    if not line.strip():
        continue
    if re.fullmatch(r"(Genesis|Exodus) \d+", line):
        verses.append(line)
        current = None
        continue
    m = re.match(r"\s+\d+ (.*)", line)
    if m:
        verses.append(m.group(1))
    else:
        verses[-1] += " " + line.strip()
sys.stdout.write("\n".join(verses) + "\n")
' > "$out"
wc -c "$out"
