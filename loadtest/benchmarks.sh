#!/usr/bin/env bash
# Every benchmark behind docs/benchmarks.md, one after another, with fixed output directories
# (loadtest/results/bench/<name>/). About 3 hours on the 2-core development machine; run it on a quiet one.
#
#   loadtest/peers/install-all.sh     # once: the peer routers (vllm-router, sglang-router, LiteLLM, nginx)
#   loadtest/benchmarks.sh            # everything; or name steps: loadtest/benchmarks.sh seed-table lab
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=loadtest/results/bench
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(seed-table seed-table-weighted degraded-node prefix-heavy no-sharing
                                 peers-heterogeneous peers-prefix-heavy peers-prefix-heavy-repeat peers-prefix-heavy-high
                                 overhead scale lab streams faults tenants)
for step in "${steps[@]}"; do
    echo "=== $step ($(date -u +%H:%M:%S))"
    case "$step" in
        overhead)
            python -m loadtest.router_overhead --out "$OUT/overhead" --envoy-epp \
                --peers vllm-router:round_robin,sglang-router:round_robin,litellm:simple-shuffle,nginx:least_conn ;;
        scale)
            mkdir -p "$OUT/scale"
            python -m loadtest.scale --json "$OUT/scale/scale.json" --markdown "$OUT/scale/scale.md" \
                --plots "$OUT/scale" ;;
        streams)
            python -m loadtest.streams --no-pin --open-rate 250 --json "$OUT/streams/streams.json" ;;
        faults)
            python -m loadtest.faults --json "$OUT/faults/faults.json" ;;
        tenants)
            python -m loadtest.tenants --json "$OUT/tenants/tenants.json" ;;
        lab)
            mkdir -p "$OUT/lab"
            LEAST_PREFILL='prefix-aware least-prefill={"strategy": "prefix-aware", "prefixAware": {"selection": "least-prefill"}}'
            for f in 0.3 0.6 0.9; do
                python -m loadtest.lab loadtest/scenarios/seed-table.yaml --fraction $f --seeds 5 \
                    --policy 'adaptive, best-score (before)={"strategy": "adaptive", "adaptive": {"selection": "best-score"}}' \
                    --policy 'adaptive, choices all={"strategy": "adaptive", "adaptive": {"choices": "all"}}' \
                    --policy "$LEAST_PREFILL" --markdown "$OUT/lab/seed-table-$f.md"
            done
            python -m loadtest.lab loadtest/scenarios/seed-table-weighted.yaml --fraction 0.6 --seeds 5 \
                --policy "$LEAST_PREFILL" --markdown "$OUT/lab/seed-table-weighted-0.6.md"
            for f in 0.5 0.8; do
                python -m loadtest.lab loadtest/scenarios/prefix-heavy.yaml --fraction $f --seeds 6 \
                    --policy 'least-prefill, maxImbalance 8={"strategy": "prefix-aware", "prefixAware": {"selection": "least-prefill", "maxImbalance": 8}}' \
                    --markdown "$OUT/lab/prefix-heavy-$f.md"
            done
            for f in 0.6 0.9; do
                python -m loadtest.lab loadtest/scenarios/no-sharing.yaml --fraction $f --seeds 8 \
                    --policy 'prefix-aware, any match (minMatchShare 0)={"strategy": "prefix-aware", "prefixAware": {"minMatchShare": 0}}' \
                    --markdown "$OUT/lab/no-sharing-$f.md"
            done ;;
        *)
            fleetroute loadtest --scenario "loadtest/scenarios/$step.yaml" --out "$OUT/$step" > "$OUT/$step.log" 2>&1
            echo "exit $? ($step)";;
    esac
done
echo "=== done ($(date -u +%H:%M:%S))"
