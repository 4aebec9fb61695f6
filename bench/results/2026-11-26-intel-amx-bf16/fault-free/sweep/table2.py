import json
G=2**30
for side in ["old-1","new-1","old-2","new-2"]:
    txt=open(f"/work/prof/sweep/{side}.txt").read()
    path=[l.split("results: ")[1] for l in txt.splitlines() if l.startswith("results: ")][0]
    d=json.load(open(path))
    for pair in d["sweep_rows"]:
        byname={x["name"]:x for x in pair}
        n,o=byname["none"]["result"],byname["nvme+opt"]["result"]
        tok=pair[0]["batch"]*pair[0]["seq"]
        cn=n["user_s_per_step"]+n["sys_s_per_step"]; co=o["user_s_per_step"]+o["sys_s_per_step"]
        gb=(o["proc_read_per_step"]+o["proc_write_per_step"])/1e9
        pr=o.get("peak_rss") or o["memory_report"].get("peak_rss") or o["memory_report"]["rss"]
        print(f"{side} {tok:5d} none {n['step_s']:.2f}s cpu {cn:.2f} | nvme+opt {o['step_s']:.2f}s (fwd {o['fwd_s']:.2f} bwd {o['bwd_s']:.2f} opt {o['opt_s']:.2f}) user {o['user_s_per_step']:.2f} sys {o['sys_s_per_step']:.2f} flt {o['minflt_per_step']/1e3:.0f}k  +cpu/GB {(co-cn)/gb:.3f} rss {pr/G:.2f}")
