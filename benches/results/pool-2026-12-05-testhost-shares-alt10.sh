exec 2>&1
B=$BULKHEAD_BIN
D=/root/.local/share/bulkhead
export BULKHEAD_SOCKET=/run/bh/d.sock
mkdir -p /run/bh/state /srv/r
mount -t tmpfs tmpfs /srv/r; chmod 755 /srv/r
BULKHEAD_DATA_DIR=/run/bh/state timeout 300 $B/bulkhead template create base --share-slots 1 --memory 256 --kernel $D/kernel/x86_64/vmlinux --initrd $D/images/default/initramfs.cpio.lz4 >/dev/null || { echo "template create failed"; exit 1; }
mkdir -p /srv/r/ws /srv/r/data
echo project > /srv/r/ws/README; echo hi > /srv/r/data/hello
chown 1000:1000 /srv/r/data
conf() {
    cat > /run/bh/d.toml <<EOT
socket = "/run/bh/d.sock"
state_dir = "/run/bh/state"
cgroups = "off"
mount_roots = ["/srv/r"]
$1
EOT
}
startd() { rm -f /run/bh/d.sock; $B/bulkheadd --config /run/bh/d.toml >/run/bh/cur.log 2>&1 & DPID=$!; while [ ! -S /run/bh/d.sock ]; do sleep 0.2; done; }
stopd() { kill $DPID; wait $DPID; cat /run/bh/cur.log >>/run/bh/d.log; }
up() { cut -d' ' -f1 /proc/uptime; }
ready() { n=0; while ! grep -q "pool: a clone of" /run/bh/cur.log && [ $n -lt 600 ]; do sleep 0.5; n=$((n+1)); done; }
round() {
    t0=$(up)
    id=$(timeout 150 $B/bulkhead create --template base --workspace /srv/r/ws:clone --mount /srv/r/data:/data)
    out=$(timeout 60 $B/bulkhead exec $id -- cat /workspace/README)
    t1=$(up)
    created=$(grep -o "sandbox running.*after [0-9.]*[mµ]*s" /run/bh/cur.log | grep -o "after [0-9.]*[mµ]*s" | tail -1)
    echo "$1 $id $(echo "$t0 $t1" | awk '{printf "%d", ($2-$1)*1000}') $out daemon-create-$created"
    timeout 60 $B/bulkhead rm $id >/dev/null
}
# Alternating rounds: the same daemon configuration cannot both pool and restore, so each
# round restarts the daemon (a pooled round waits for its clone first; both restore from the
# same template on the same page cache).
i=0
while [ $i -lt 10 ]; do
    conf '[pool]
template = "base"
size = 1
share_owner = [1000, 1000]'
    startd; ready; round pooled; stopd
    conf ''
    startd; round restored; stopd
    i=$((i + 1))
done
echo "--- daemon's own create times"
grep -o "sandbox running.*after [0-9.]*[mµ]*s" /run/bh/d.log
