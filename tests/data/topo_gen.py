# Writes the synthetic hwloc 2.x XML topologies of tests/test_hwloc.c (tests/data/topo_*.xml, committed):
#   python3 tests/data/topo_gen.py tests/data
# The files are what the tests read; this script only documents how they were made and makes edits easy.
import sys
gp = [0]
def g():
    gp[0] += 1
    return gp[0]
def mask(pus):
    v = 0
    for p in pus: v |= 1 << p
    return "0x%08x" % v
def sets(pus, nodes):
    c = mask(pus); n = mask(nodes)
    return 'cpuset="%s" complete_cpuset="%s" nodeset="%s" complete_nodeset="%s"' % (c, c, n, n)
def core(i, pus, node, ind):
    s = ind + '<object type="Core" os_index="%d" %s gp_index="%d">\n' % (i, sets(pus, [node]), g())
    for p in pus:
        s += ind + '  <object type="PU" os_index="%d" %s gp_index="%d"/>\n' % (p, sets([p], [node]), g())
    return s + ind + '</object>\n'
def numa(n, pus, mem, ind):
    return ind + '<object type="NUMANode" os_index="%d" %s gp_index="%d" local_memory="%d"/>\n' % (n, sets(pus, [n]), g(), mem)
def osdev(name, t, ind, subtype=None, infos=()):
    st = ' subtype="%s"' % subtype if subtype else ''
    s = ind + '<object type="OSDev" gp_index="%d" name="%s"%s osdev_type="%d"' % (g(), name, st, t)
    if not infos: return s + '/>\n'
    s += '>\n'
    for k, v in infos: s += ind + '  <info name="%s" value="%s"/>\n' % (k, v)
    return s + ind + '</object>\n'
def pcidev(busid, ptype, ind, children=''):
    s = ind + '<object type="PCIDev" gp_index="%d" pci_busid="%s" pci_type="%s" pci_link_speed="15.753846"' % (g(), busid, ptype)
    if not children: return s + '/>\n'
    return s + '>\n' + children + ind + '</object>\n'
def hostbridge(rng, ind, children):
    return ind + '<object type="Bridge" gp_index="%d" bridge_type="0-1" depth="0" bridge_pci="%s">\n' % (g(), rng) + children + ind + '</object>\n'
def switch(busid, rng, ind, children):
    return (ind + '<object type="Bridge" gp_index="%d" pci_busid="%s" pci_type="0604 [10b5:8747] [0000:0000] ca" pci_link_speed="15.753846" bridge_type="1-1" depth="1" bridge_pci="%s">\n'
            % (g(), busid, rng) + children + ind + '</object>\n')
def gpu(busid, cuda, ind):
    ch = ''
    if cuda is not None:
        ch = osdev('cuda%d' % cuda, 5, ind + '  ', 'CUDA', [('Backend', 'CUDA'), ('GPUVendor', 'NVIDIA Corporation'), ('GPUModel', 'NVIDIA A100-SXM4-40GB')])
    return pcidev(busid, '0302 [10de:20b0] [10de:134f] a1', ind, ch)
def ib(busid, hca, netdev, ind):
    ch = osdev(hca, 3, ind + '  ', 'OpenFabrics', [('NodeGUID', '0c42:a103:00%s:0000' % busid[5:7]), ('Port1State', '4')])
    ch += osdev(netdev, 2, ind + '  ', None, [('Address', '00:00:10:87:fe:80')])
    return pcidev(busid, '0207 [15b3:101b] [15b3:0007] 00', ind, ch)
def eth(busid, name, ind):
    return pcidev(busid, '0200 [8086:1521] [15d9:1521] 01', ind, osdev(name, 2, ind + '  ', None, [('Address', '3c:ec:ef:00:00:01')]))
def machine(pus, nodes, children, name):
    gp[0] = 0
    s = '<?xml version="1.0" encoding="UTF-8"?>\n<!DOCTYPE topology SYSTEM "hwloc2.dtd">\n<topology version="2.0">\n'
    c = mask(pus); n = mask(nodes)
    s += '  <object type="Machine" os_index="0" %s allowed_cpuset="%s" allowed_nodeset="%s" gp_index="%d">\n' % (sets(pus, nodes), c, n, g())
    s += '    <info name="Backend" value="Synthetic"/>\n    <info name="HostName" value="%s"/>\n    <info name="Architecture" value="x86_64"/>\n' % name
    s += children + '  </object>\n</topology>\n'
    return s

# Two sockets, one NUMA node each, 8 cores x 2 hyperthreads per socket (core c: PUs c and c+16), four
# GPUs and two InfiniBand NICs on PCI, an Ethernet port on socket 0.
def server():
    ind = '      '
    p0 = [c for c in range(8)] + [c + 16 for c in range(8)]
    p1 = [c for c in range(8, 16)] + [c + 16 for c in range(8, 16)]
    s = '    <object type="Package" os_index="0" %s gp_index="%d">\n' % (sets(p0, [0]), g())
    s += '      <info name="CPUModel" value="Intel(R) Xeon(R) Gold 6130 CPU @ 2.10GHz"/>\n'
    s += numa(0, p0, 200 << 30, ind)
    for c in range(8): s += core(c, [c, c + 16], 0, ind)
    s += hostbridge('0000:[18-18]', ind, eth('0000:18:00.0', 'eno1', ind + '  '))
    s += hostbridge('0000:[3a-3c]', ind, switch('0000:3a:00.0', '0000:[3b-3c]', ind + '  ',
                    gpu('0000:3b:00.0', 1, ind + '    ') + ib('0000:3c:00.0', 'mlx5_0', 'ib0', ind + '    ')))
    s += hostbridge('0000:[5e-5e]', ind, gpu('0000:5e:00.0', 3, ind + '  '))
    s += '    </object>\n'
    s += '    <object type="Package" os_index="1" %s gp_index="%d">\n' % (sets(p1, [1]), g())
    s += '      <info name="CPUModel" value="Intel(R) Xeon(R) Gold 6130 CPU @ 2.10GHz"/>\n'
    s += numa(1, p1, 200 << 30, ind)
    for c in range(8, 16): s += core(c, [c, c + 16], 1, ind)
    s += hostbridge('0000:[af-b1]', ind, switch('0000:af:00.0', '0000:[b0-b1]', ind + '  ',
                    gpu('0000:b0:00.0', 2, ind + '    ') + ib('0000:b1:00.0', 'mlx5_1', 'ib1', ind + '    ')))
    s += hostbridge('0000:[d8-d8]', ind, gpu('0000:d8:00.0', 0, ind + '  '))
    s += '    </object>\n'
    return machine(range(32), [0, 1], s, 'server2s4g')

# A laptop: one socket, one NUMA node, 4 cores x 2 threads (core c: PUs 2c, 2c+1), an integrated GPU and a
# discrete NVIDIA GPU (no CUDA OS device) and Wi-Fi on PCI.
def laptop():
    ind = '      '
    pus = list(range(8))
    s = '    <object type="Package" os_index="0" %s gp_index="%d">\n' % (sets(pus, [0]), g())
    s += numa(0, pus, 16 << 30, ind)
    for c in range(4): s += core(c, [2 * c, 2 * c + 1], 0, ind)
    br = pcidev('0000:00:02.0', '0300 [8086:9a49] [17aa:22d8] 01', ind + '  ', osdev('card0', 1, ind + '    '))
    br += switch('0000:00:01.0', '0000:[01-01]', ind + '  ', pcidev('0000:01:00.0', '0300 [10de:25a2] [17aa:22d8] a1', ind + '    '))
    br += switch('0000:00:1c.0', '0000:[02-02]', ind + '  ', pcidev('0000:02:00.0', '0280 [8086:2725] [8086:0024] 1a', ind + '    ',
                 osdev('wlp2s0', 2, ind + '      ', None, [('Address', 'a4:c3:f0:00:00:01')])))
    s += hostbridge('0000:[00-02]', ind, br)
    s += '    </object>\n'
    return machine(pus, [0], s, 'laptop')

# Six cores without hyperthreads, one package in two NUMA nodes of three (sub-NUMA clustering), no I/O:
# fewer cores than a plan's threads.
def small():
    ind = '        '
    s = '    <object type="Package" os_index="0" %s gp_index="%d">\n' % (sets(range(6), [0, 1]), g())
    for n in range(2):
        pus = [3 * n + i for i in range(3)]
        s += '      <object type="Group" %s gp_index="%d">\n' % (sets(pus, [n]), g())
        s += numa(n, pus, 4 << 30, ind)
        for c in pus: s += core(c, [c], n, ind)
        s += '      </object>\n'
    s += '    </object>\n'
    return machine(range(6), [0, 1], s, 'small6')

for name, f in [('server2s4g', server), ('laptop', laptop), ('small6', small)]:
    open(sys.argv[1] + '/topo_%s.xml' % name, 'w').write(f())
