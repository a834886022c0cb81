/* kern_kda.h — part of kern_tmpl.h (included there, once per ISA unit): KDA per head. */
